-- Releases a probe lease whose caller is gone (B3: as a probe ended without a verdict),
-- found by the claim its admission sent; any other lease, or none, is left alone.
-- KEYS[1]: the source's gate hash. ARGV[1]: the claim.
-- Returns 1 released, 0 nothing to release.
local key = KEYS[1]
local g = redis.call('HMGET', key, 'probe_claim', 'probe_until')
if g[1] ~= ARGV[1] or (tonumber(g[2]) or 0) == 0 then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', key, 'probe_until', 0, 'open_until', now)
return 1

-- Admission (B1), atomic, one round trip. The same machine as src/state.rs.
-- KEYS[1]: the source's gate hash.
-- ARGV: probe_ttl_ms, cooldown_ms, key_ttl_ms, claim (unique per question: kept with a
--       probe lease, so release.lua can free it when the question's caller is gone).
-- Returns {admitted (1|0), epoch, probe lease id (0: not a probe), retry_after_ms,
--          open (1: refused because open until retry_after, 0 otherwise)}.
local key = KEYS[1]
local g = redis.call('HMGET', key, 'open', 'epoch', 'open_until', 'probe_id', 'probe_until')
local epoch = tonumber(g[2]) or 0
if g[1] ~= '1' then
  -- Closed: admitted whatever the time (the clock is read only when open).
  return {1, epoch, 0, 0, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local open_until = tonumber(g[3]) or 0
if now < open_until then
  return {0, epoch, 0, open_until - now, 1}
end
local probe_until = tonumber(g[5]) or 0
if probe_until ~= 0 and now < probe_until then
  return {0, epoch, 0, math.min(probe_until - now, tonumber(ARGV[2])), 0}
end
local probe = (tonumber(g[4]) or 0) + 1
redis.call('HSET', key, 'probe_id', probe, 'probe_until', now + tonumber(ARGV[1]), 'probe_claim', ARGV[4])
redis.call('PEXPIRE', key, ARGV[3])
return {1, epoch, probe, 0, 0}

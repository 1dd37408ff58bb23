-- Renews one concurrency lease in every scope that holds it (a long call keeps its slot).
-- KEYS: c (lease zset) per scope. ARGV: lease_id, lease_ttl_ms.
-- Returns how many scopes still held the lease (fewer means it had expired).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local renewed = 0
for i = 1, #KEYS do
  -- A lease past its expiry but not yet purged is revived: nobody took its slot,
  -- because every admission purges expired leases before counting.
  if redis.call('ZSCORE', KEYS[i], ARGV[1]) then
    redis.call('ZADD', KEYS[i], now + ttl, ARGV[1])
    -- The zset outlives this lease, and is never shortened: a limiter sharing the
    -- scope may lease for longer (its live leases would end with the zset).
    if redis.call('PTTL', KEYS[i]) < ttl then
      redis.call('PEXPIRE', KEYS[i], 2 * ttl)
    end
    renewed = renewed + 1
  end
end
return renewed

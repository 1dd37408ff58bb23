-- Settles one admission after the call: reconciles the token reservation to real usage
-- (or refunds the request and its tokens when the call was not admitted below), in the
-- window of admission only, and releases the concurrency lease. One round trip.
--
-- KEYS, two per scope: q (window hash), c (lease zset)
-- ARGV: nscopes, window, delta_requests, delta_tokens, lease_id ('' = none)
-- A window that has already rolled over is left alone: its quota no longer matters.
local n = tonumber(ARGV[1])
local win = tonumber(ARGV[2])
local dr = tonumber(ARGV[3])
local dt = tonumber(ARGV[4])
local lease = ARGV[5]
for i = 0, n - 1 do
  local q, c = KEYS[2 * i + 1], KEYS[2 * i + 2]
  if (dr ~= 0 or dt ~= 0) and tonumber(redis.call('HGET', q, 'w')) == win then
    if redis.call('HINCRBY', q, 'r', dr) < 0 then
      redis.call('HSET', q, 'r', 0)
    end
    if redis.call('HINCRBY', q, 't', dt) < 0 then
      redis.call('HSET', q, 't', 0)
    end
  end
  if lease ~= '' then
    redis.call('ZREM', c, lease)
  end
end
return 1

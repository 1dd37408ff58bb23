-- Settles one admission after the call: reconciles the token reservation to real usage
-- (or refunds the request and its tokens when the call was not admitted below), in the
-- window of admission only, and releases the concurrency lease. One round trip.
--
-- KEYS, two per scope: q (window hash), c (lease zset)
-- ARGV: nscopes, window, delta_requests, delta_tokens, lease_id ('' = none),
--       then per scope: rpm, tpm, concurrency (-1 = unlimited)
-- Only what a scope limits is touched. A window that has already rolled over is left
-- alone: its quota no longer matters.
local n = tonumber(ARGV[1])
local win = tonumber(ARGV[2])
local dr = tonumber(ARGV[3])
local dt = tonumber(ARGV[4])
local lease = ARGV[5]
for i = 0, n - 1 do
  local q, c = KEYS[2 * i + 1], KEYS[2 * i + 2]
  local r = tonumber(ARGV[6 + 3 * i]) >= 0 and dr ~= 0
  local tk = tonumber(ARGV[7 + 3 * i]) >= 0 and dt ~= 0
  if (r or tk) and tonumber(redis.call('HGET', q, 'w')) == win then
    if r and redis.call('HINCRBY', q, 'r', dr) < 0 then
      redis.call('HSET', q, 'r', 0)
    end
    if tk and redis.call('HINCRBY', q, 't', dt) < 0 then
      redis.call('HSET', q, 't', 0)
    end
  end
  if lease ~= '' and tonumber(ARGV[8 + 3 * i]) >= 0 then
    redis.call('ZREM', c, lease)
  end
end
return 1

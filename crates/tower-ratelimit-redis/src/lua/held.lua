-- Reads what the scopes of one limiter hold now, on the server clock; writes nothing
-- (expired leases are left for the next admission to purge). One round trip.
--
-- KEYS, two per scope (account first, then source; all share one hash tag):
--   c  zset of concurrency leases, scored by expiry (ms)
--   h  hold: the instant (ms) until which the scope is not admitted
-- Returns {now_ms, then per scope: live_leases, last_lease_expiry_ms (0 = none),
--          hold_until_ms (0 = none)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i = 0, #KEYS / 2 - 1 do
  local c, h = KEYS[2 * i + 1], KEYS[2 * i + 2]
  -- Live means expiring after now, as admission counts them (it purges up to now).
  local live = redis.call('ZCOUNT', c, '(' .. now, '+inf')
  local last = 0
  if live > 0 then
    last = tonumber(redis.call('ZRANGE', c, -1, -1, 'WITHSCORES')[2])
  end
  local hold = tonumber(redis.call('GET', h) or '0')
  if hold <= now then
    hold = 0
  end
  out[#out + 1] = live
  out[#out + 1] = last
  out[#out + 1] = hold
end
return out

-- Reads the holds of one limiter's scopes and the server clock, writing nothing: how a
-- limiter with nothing else to enforce refreshes its cached holds (at most once per
-- `hold_refresh`, never on every admission). One round trip.
--
-- KEYS: h (hold end, ms) per scope, account first; all share one hash tag.
-- Returns {now_ms, then per scope: hold_until_ms (0 = none)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {now}
for i = 1, #KEYS do
  out[#out + 1] = tonumber(redis.call('GET', KEYS[i]) or '0')
end
return out

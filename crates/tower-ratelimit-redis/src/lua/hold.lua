-- Holds scopes (a source, its account) until now + duration on the server clock (L9).
-- A hold only ever extends: a shorter hold never cuts a longer one.
-- The end's parity says why (read by every process from the end it learns): odd after
-- an overloaded provider's pushback (ARGV[2] = 1), even after a rate limit; the end is
-- rounded up (by 1 ms at most) to it, never down. The longest hold keeps its reason.
-- KEYS: h per scope. ARGV: duration_ms, overloaded (1 or 0).
-- Returns {now_ms, then per key: the end of its hold now (ms; 0 = none)}: this one's,
-- or a longer one's already there, with that one's parity.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local d = tonumber(ARGV[1])
local untl = now + d
if d > 0 and untl % 2 ~= tonumber(ARGV[2] or '0') then
  untl = untl + 1
end
local out = {now}
for i = 1, #KEYS do
  local cur = tonumber(redis.call('GET', KEYS[i]) or '0')
  if untl > cur and d > 0 then
    redis.call('SET', KEYS[i], untl, 'PX', untl - now)
    cur = untl
  end
  out[#out + 1] = cur
end
return out

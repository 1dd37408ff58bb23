-- Holds scopes (a source, its account) until now + duration on the server clock (L9).
-- A hold only ever extends: a shorter hold never cuts a longer one.
-- KEYS: h per scope. ARGV: duration_ms. Returns {now_ms, until_ms}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local d = tonumber(ARGV[1])
local untl = now + d
for i = 1, #KEYS do
  local cur = tonumber(redis.call('GET', KEYS[i]) or '0')
  if untl > cur and d > 0 then
    redis.call('SET', KEYS[i], untl, 'PX', d)
  end
end
return {now, untl}

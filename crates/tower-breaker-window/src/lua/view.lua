-- The state view, read-only, one round trip.
-- KEYS[1]: the source's gate hash. Returns the server time (ms) then the fields.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local g = redis.call('HMGET', KEYS[1], 'open', 'epoch', 'open_until', 'probe_id', 'probe_until',
  'failures', 'win_id', 'a0', 'f0', 'a1', 'f1', 'streak', 'closed_since')
local out = {now}
for i = 1, #g do
  out[i + 1] = tonumber(g[i]) or 0
end
return out

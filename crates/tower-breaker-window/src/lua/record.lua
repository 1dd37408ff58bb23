-- Record one verdict (B2..B9), atomic, one round trip. The same machine as src/state.rs.
-- KEYS[1]: the source's gate hash.
-- ARGV: epoch, probe, verdict ('s' success | 'f' failure | 'o' force open | 'i' ignore),
--       threshold, min_calls, fail_rate, half_window_ms, cooldown_ms, max_cooldown_ms,
--       key_ttl_ms, oks: successes of the same epoch the process counted before this
--       verdict and did not send (deferred within its closed view), counted first, in
--       the same order as if each had been recorded (a non-probe ticket only).
-- Returns 0 nothing changed, 1 counted, 2 opened, 3 closed, 4 stale epoch (nothing changed).
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local g = redis.call('HMGET', key, 'open', 'epoch', 'open_until', 'probe_id', 'probe_until',
  'failures', 'win_id', 'a0', 'f0', 'a1', 'f1', 'streak', 'closed_since', 'ttl_end')
local open = g[1] == '1'
local epoch = tonumber(g[2]) or 0
local ticket_epoch = tonumber(ARGV[1])
local ticket_probe = tonumber(ARGV[2])
local verdict = ARGV[3]
if ticket_epoch ~= epoch then
  return 4
end
local threshold = tonumber(ARGV[4])
local min_calls = tonumber(ARGV[5])
local fail_rate = tonumber(ARGV[6])
local half = tonumber(ARGV[7])
local cooldown = tonumber(ARGV[8])
local max_cooldown = tonumber(ARGV[9])
local ttl = ARGV[10]
local streak = tonumber(g[12]) or 0

local function open_for(s)
  if s < 1 then s = 1 end
  local d = cooldown * 2 ^ math.min(s - 1, 40)
  if d > max_cooldown then d = max_cooldown end
  return d
end

local function trip(s)
  redis.call('HSET', key, 'open', 1, 'epoch', epoch + 1, 'open_until', now + open_for(s),
    'probe_until', 0, 'closed_since', 0, 'streak', s)
  redis.call('PEXPIRE', key, ttl)
end

if ticket_probe ~= 0 then
  if not open then
    return 0
  end
  -- An earlier probe of this open period (its lease expired and was issued again)
  -- still closes on a success; any other verdict is the current probe's to give.
  local probe_id = tonumber(g[4]) or 0
  local current = ticket_probe == probe_id and (tonumber(g[5]) or 0) ~= 0
  if not current and not (verdict == 's' and ticket_probe <= probe_id) then
    return 0
  end
  if verdict == 's' then
    redis.call('HSET', key, 'open', 0, 'epoch', epoch + 1, 'probe_until', 0, 'failures', 0,
      'a0', 0, 'f0', 0, 'a1', 0, 'f1', 0, 'closed_since', now)
    redis.call('PEXPIRE', key, ttl)
    return 3
  elseif verdict == 'o' then
    -- A dead source's probe (B7): the streak grows.
    trip(streak + 1)
    return 2
  elseif verdict == 'f' then
    -- A transient failure does not grow it: probed again after one open period.
    trip(streak)
    return 2
  end
  -- B3: no verdict; the next admission may probe at once.
  redis.call('HSET', key, 'probe_until', 0, 'open_until', now)
  redis.call('PEXPIRE', key, ttl)
  return 1
end
if open or verdict == 'i' then
  return 0
end

-- Rotate the two fixed buckets by window id (B5): zero the bucket being reused.
local w = math.floor(now / half)
local win = tonumber(g[7]) or 0
local a = {tonumber(g[8]) or 0, tonumber(g[10]) or 0}
local f = {tonumber(g[9]) or 0, tonumber(g[11]) or 0}
if w > win then
  if w == win + 1 then
    a[(w % 2) + 1] = 0
    f[(w % 2) + 1] = 0
  else
    a = {0, 0}
    f = {0, 0}
  end
  win = w
end
local b = (win % 2) + 1
local oks = tonumber(ARGV[11]) or 0
a[b] = a[b] + 1 + oks
local failures = tonumber(g[6]) or 0
if verdict == 's' or oks > 0 then
  failures = 0
  local closed_since = tonumber(g[13]) or 0
  if streak > 0 and closed_since ~= 0 and now - closed_since >= 2 * open_for(streak) then
    streak = 0
  end
end
if verdict ~= 's' then
  f[b] = f[b] + 1
  failures = failures + 1
end
-- A count renews the TTL only once less than half of it is left (a PEXPIRE per record
-- was a fifth of the script's commands); 'ttl_end' is when it was last set to end.
-- Every PEXPIRE of this hash sets it to end a key TTL from then, so the hash never
-- ends before its 'ttl_end'; a hash that ended is read without one, and renewed.
local renew = (tonumber(g[14]) or 0) - now < tonumber(ttl) / 2
local fields = {'failures', failures, 'win_id', win, 'a0', a[1], 'f0', f[1],
  'a1', a[2], 'f1', f[2], 'streak', streak}
if renew then
  fields[#fields + 1] = 'ttl_end'
  fields[#fields + 1] = now + tonumber(ttl)
end
redis.call('HSET', key, unpack(fields))
if renew then
  redis.call('PEXPIRE', key, ttl)
end
if verdict == 's' then
  return 1
end
if verdict == 'o' then
  trip(streak + 1)
  return 2
end
local calls = a[1] + a[2]
local fails = f[1] + f[2]
if calls >= min_calls and calls > 0 and fails / calls >= fail_rate then
  -- Rate channel: pins the failure count (B9); transient failures do not grow the streak.
  redis.call('HSET', key, 'failures', threshold)
  trip(streak)
  return 2
end
if failures >= threshold and calls < min_calls then
  -- Consecutive channel, unless the window holds enough evidence of health (B8).
  trip(streak)
  return 2
end
return 1

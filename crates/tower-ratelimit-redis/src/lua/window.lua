-- Sliding windows counted per sub-window, shared by admit.lua and settle.lua (prepended
-- to each); the same rules as src/backend/sliding.rs.
--
-- A window is k sub-windows of g ms. At sub-window cur = floor(now / g), the
-- sub-windows cur - k .. cur are live: together they cover the whole span of one window
-- ending now, so their sum never undercounts any span, and an admission that keeps it
-- within the quota keeps every span of the window's length within it. What sub-window
-- b holds leaves at (b + k + 1) * g: at most one sub-window later than an exact log.
--
-- A scope's window hash:
--   o      the oldest sub-window kept (older ones are out of the totals)
--   r, t   requests and tokens over the sub-windows kept
--   l      the newest sub-window written (the hash's TTL was set then)
--   r<b>, t<b>  sub-window b's counts
-- Sub-windows are written only at the current one, after a roll: everything kept lies
-- in o .. l, at most k + 1 sub-windows.

-- Drops from hash q what is no longer live at sub-window cur. Returns requests,
-- tokens, the newest sub-window written (false: no hash) and the oldest kept.
local function roll(q, cur, k)
  local st = redis.call('HMGET', q, 'o', 'r', 't', 'l')
  local o = tonumber(st[1])
  if not o then
    return 0, 0, false, cur - k
  end
  local r, tk = tonumber(st[2]) or 0, tonumber(st[3]) or 0
  local l = tonumber(st[4]) or o
  local oldest = cur - k
  if o >= oldest then
    return r, tk, l, o
  end
  if l < oldest then
    -- Nothing kept is live any more.
    redis.call('DEL', q)
    return 0, 0, false, oldest
  end
  local f = {}
  for b = o, oldest - 1 do
    f[#f + 1] = 'r' .. b
    f[#f + 1] = 't' .. b
  end
  local v = redis.call('HMGET', q, unpack(f))
  for i = 1, #v, 2 do
    r = r - (tonumber(v[i]) or 0)
    tk = tk - (tonumber(v[i + 1]) or 0)
  end
  if r < 0 then r = 0 end
  if tk < 0 then tk = 0 end
  redis.call('HDEL', q, unpack(f))
  redis.call('HSET', q, 'o', oldest, 'r', r, 't', tk)
  return r, tk, l, oldest
end

-- Adds dr requests and dt tokens at sub-window cur of hash q, after roll (newest is
-- what it answered). The TTL covers the newest sub-window's life: (k + 2) * g.
local function add(q, cur, k, g, dr, dt, newest)
  if not newest then
    local f = {'o', cur - k, 'r', dr, 't', dt, 'l', cur}
    if dr ~= 0 then
      f[#f + 1] = 'r' .. cur
      f[#f + 1] = dr
    end
    if dt ~= 0 then
      f[#f + 1] = 't' .. cur
      f[#f + 1] = dt
    end
    redis.call('HSET', q, unpack(f))
    redis.call('PEXPIRE', q, (k + 2) * g)
    return
  end
  if dr ~= 0 then
    redis.call('HINCRBY', q, 'r' .. cur, dr)
    redis.call('HINCRBY', q, 'r', dr)
  end
  if dt ~= 0 then
    redis.call('HINCRBY', q, 't' .. cur, dt)
    redis.call('HINCRBY', q, 't', dt)
  end
  if cur > newest then
    redis.call('HSET', q, 'l', cur)
    redis.call('PEXPIRE', q, (k + 2) * g)
  end
end

-- How long until hash q has room for need more of count c ('r' or 't') within limit,
-- given its total: until the first sub-window whose departure frees enough leaves.
-- Read only when refusing.
local function wait_for(q, c, total, need, limit, cur, k, g, now)
  local excess = total + need - limit
  local f = {}
  for b = cur - k, cur do
    f[#f + 1] = c .. b
  end
  local v = redis.call('HMGET', q, unpack(f))
  local freed = 0
  for i = 1, #v do
    freed = freed + (tonumber(v[i]) or 0)
    if freed >= excess then
      -- Sub-window cur - k + i - 1 leaves at (cur + i) * g.
      return (cur + i) * g - now
    end
  end
  return (cur + k + 1) * g - now
end


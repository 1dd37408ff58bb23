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
--   l      the newest sub-window written
--   e      a sub-window before which the hash's TTL does not end
--   ce     when (server ms) the scope's lease zset's TTL was last set to end (admit.lua)
--   z      the oldest sub-window whose cells may still be in the hash (absent: o)
--   r<b>, t<b>  sub-window b's counts
-- Sub-windows are written only at the current one, after a roll (and given back at the
-- one of their admission): everything kept lies in o .. l, at most k + 1 sub-windows.
-- The cells of sub-windows that left (z .. o - 1) are out of the totals and read by
-- nothing; they are deleted in batches, once a quarter window of them has gathered,
-- not at every roll (an HDEL was a sixth of a settle's commands).
--
-- Redis commands are what a script costs (each counts in INFO commandstats), so a
-- scope is read with one HMGET and written with one HSET: read() gathers the state and
-- the cells an admission or a settle touches, the caller changes them in Lua, write()
-- stores what changed. The TTL is set for two windows and renewed only once less than
-- one window and two sub-windows of it are left, not at every write.

-- Reads hash q at sub-window cur, with the cells of sub-windows cur and, when given,
-- at (one sub-window, or a list of them). Drops, in the state it answers (written by
-- write()), the sub-windows no longer live. The state: r, t (totals), l (newest
-- written; false: no live hash), o (oldest kept), e, ce, z, cell (field -> count),
-- dirty (fields changed), moved (o moved on), drop (fields to delete), dead (a hash
-- whose every sub-window left: deleted by write()).
local function read(q, cur, k, at)
  local f = {'o', 'r', 't', 'l', 'e', 'ce', 'z', 'r' .. cur, 't' .. cur}
  local seen = {[cur] = true}
  for _, b in ipairs(type(at) == 'table' and at or {at}) do
    if not seen[b] then
      seen[b] = true
      f[#f + 1] = 'r' .. b
      f[#f + 1] = 't' .. b
    end
  end
  local v = redis.call('HMGET', q, unpack(f))
  local oldest = cur - k
  local st = {r = 0, t = 0, l = false, o = oldest, e = 0, ce = 0, cell = {}, dirty = {}}
  local o = tonumber(v[1])
  if not o then
    return st
  end
  local l = tonumber(v[4]) or o
  if l < oldest then
    -- Nothing kept is live any more.
    st.dead = true
    return st
  end
  st.r, st.t, st.l, st.o = tonumber(v[2]) or 0, tonumber(v[3]) or 0, l, o
  st.e = tonumber(v[5]) or 0
  st.ce = tonumber(v[6]) or 0
  st.z = tonumber(v[7]) or o
  for i = 8, #f do
    st.cell[f[i]] = tonumber(v[i]) or 0
  end
  if o < oldest then
    local d = {}
    for b = o, oldest - 1 do
      d[#d + 1] = 'r' .. b
      d[#d + 1] = 't' .. b
    end
    local old = redis.call('HMGET', q, unpack(d))
    for i = 1, #old, 2 do
      st.r = st.r - (tonumber(old[i]) or 0)
      st.t = st.t - (tonumber(old[i + 1]) or 0)
    end
    if st.r < 0 then st.r = 0 end
    if st.t < 0 then st.t = 0 end
    st.o = oldest
    st.moved = true
    -- A given-back cell of a sub-window just dropped is out of the totals already.
    for i = 1, #d do
      st.cell[d[i]] = nil
    end
    if oldest - st.z >= math.max(1, math.floor(k / 4)) then
      -- Delete every cell that left, these and those left before.
      local all = {}
      for b = st.z, oldest - 1 do
        all[#all + 1] = 'r' .. b
        all[#all + 1] = 't' .. b
      end
      st.drop = all
      st.z = oldest
    end
  end
  return st
end

-- Adds d to count c ('r' or 't') at sub-window cur.
local function add(st, c, cur, d)
  if d == 0 then return end
  local f = c .. cur
  st.cell[f] = (st.cell[f] or 0) + d
  st.dirty[f] = true
  st[c] = st[c] + d
  if not st.l or cur > st.l then st.l = cur end
end

-- Gives back up to -d (d < 0) of count c at sub-window at, while it is still kept
-- (never below zero).
local function back(st, c, at, d)
  if d >= 0 or not st.l or at < st.o or at > st.l then return end
  local f = c .. at
  local v = st.cell[f]
  if not v then return end
  local nv = v + d
  if nv < 0 then nv = 0 end
  st.cell[f] = nv
  st.dirty[f] = true
  st[c] = st[c] + (nv - v)
end

-- The token refunds a script carries, deferred by the process (see Deferred in
-- src/backend/redis.rs): ARGV[base] = m, then m pairs (admitted_ms, tokens < 0).
-- Answers them as {sub-window, tokens}, and their sub-windows (for read()).
local function carried(base, g)
  local m = tonumber(ARGV[base]) or 0
  local backs, ats = {}, {}
  for j = 1, m do
    local b = math.floor(tonumber(ARGV[base + 2 * j - 1]) / g)
    backs[j] = {b, tonumber(ARGV[base + 2 * j])}
    ats[j] = b
  end
  return backs, ats
end

-- Gives back the tokens of carried() refunds to state st.
local function give_back(st, backs)
  for _, r in ipairs(backs) do
    back(st, 't', r[1], r[2])
  end
end

-- Writes what read() moved (and deletes what it dropped) and the cells add() and back()
-- changed, in one HSET, and
-- the TTL when less than (k + 2) sub-windows of it would be left: it is then set to
-- (2k + 2) sub-windows, so a hash outlives its newest sub-window's life.
local function write(q, st, cur, k, g)
  if not next(st.dirty) and not st.moved then return end
  if st.dead then
    redis.call('DEL', q)
  end
  if st.drop then
    redis.call('HDEL', q, unpack(st.drop))
  end
  local f = {'o', st.o, 'r', st.r, 't', st.t, 'l', st.l or cur, 'z', st.z or st.o}
  for field in pairs(st.dirty) do
    f[#f + 1] = field
    f[#f + 1] = st.cell[field]
  end
  local renew = st.e < cur + k + 2
  if renew then
    f[#f + 1] = 'e'
    f[#f + 1] = cur + 2 * k + 2
  end
  redis.call('HSET', q, unpack(f))
  if renew then
    redis.call('PEXPIRE', q, (2 * k + 2) * g)
  end
end

-- How long until hash q has room for need more of count c ('r' or 't') within limit,
-- given its total: until the first sub-window whose departure frees enough leaves.
-- Read only when refusing. cell, when given, holds counts changed since they were
-- read and not yet written (a refund applied before the checks).
local function wait_for(q, c, total, need, limit, cur, k, g, now, cell)
  local excess = total + need - limit
  local f = {}
  for b = cur - k, cur do
    f[#f + 1] = c .. b
  end
  local v = redis.call('HMGET', q, unpack(f))
  local freed = 0
  for i = 1, #v do
    local changed = cell and cell[f[i]]
    freed = freed + (changed or tonumber(v[i]) or 0)
    if freed >= excess then
      -- Sub-window cur - k + i - 1 leaves at (cur + i) * g.
      return (cur + i) * g - now
    end
  end
  return (cur + k + 1) * g - now
end

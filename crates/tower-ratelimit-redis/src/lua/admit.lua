-- Checks and reserves every dimension of every scope of one admission, atomically
-- (all or nothing), on the server clock. One call = one round trip (L3). Prepended
-- with window.lua (read, add, write, wait_for).
--
-- KEYS, three per scope (account first, then source; all share one hash tag):
--   w  the scope's sliding window (hash, see window.lua)
--   c  zset of concurrency leases, scored by expiry (ms)
--   h  hold: the instant (ms) until which the scope is not admitted
-- ARGV: nscopes, window_ms, sub_ms, subs, tokens, lease_id ('' = no lease),
--       lease_ttl_ms, slot_hint_ms, then per scope: rpm, tpm, concurrency (-1 = unlimited),
--       then m and m pairs (admitted_ms, tokens < 0): token refunds of earlier settles
--       of these scopes that the process deferred to this admission (see settle.lua),
--       given back (to each scope with a tpm) before the checks, refused or not.
-- Returns {1, now_ms, window, scope_index, dimension, wait_ms, room...} when admitted
--         (window: the aligned window's id, a label; dimension 0, or what this
--         admission filled: 1 its last request, 3 its last slot, and how long until it
--         frees, the longest wait winning, so the process does not ask before; then
--         per scope the requests or slots it has left, the fewer, -1 when it counts
--         neither: how many may ask at once),
--         {0, now_ms, scope_index, dimension, retry_after_ms} when not
--         (dimension: 1 rpm, 2 tpm, 3 concurrency, 4 hold; the longest wait wins).
--
-- Only what a scope limits is read or written: a scope without rpm and tpm has no
-- window hash; expired leases are purged only when the slots look full (ZCARD is O(1)).
-- The holds of every scope are read with one MGET (one hash tag: one slot), each
-- window with one HMGET, and an admission writes each window with one HSET.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[1])
local wms = tonumber(ARGV[2])
local g = tonumber(ARGV[3])
local k = tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
local lease = ARGV[6]
local ttl = tonumber(ARGV[7])
local hint = tonumber(ARGV[8])
local cur = math.floor(now / g)

local backs, ats = carried(9 + 3 * n, g)

local worst_dim, worst_scope, worst_wait = 0, 0, -1
local function refuse(i, dim, wait)
  if wait > worst_wait then
    worst_dim, worst_scope, worst_wait = dim, i, wait
  end
end

local holds = {}
for i = 0, n - 1 do
  holds[#holds + 1] = KEYS[3 * i + 3]
end
holds = redis.call('MGET', unpack(holds))

local windows = {}
local lives = {}
for i = 0, n - 1 do
  local w, c = KEYS[3 * i + 1], KEYS[3 * i + 2]
  local rpm = tonumber(ARGV[9 + 3 * i])
  local tpm = tonumber(ARGV[10 + 3 * i])
  local conc = tonumber(ARGV[11 + 3 * i])
  local hold = tonumber(holds[i + 1] or '0') or 0
  if hold > now then
    refuse(i, 4, hold - now)
  end
  if rpm >= 0 or tpm >= 0 then
    local st = read(w, cur, k, ats)
    windows[i] = st
    if tpm >= 0 then
      give_back(st, backs)
    end
    if rpm >= 0 and st.r + 1 > rpm then
      refuse(i, 1, wait_for(w, 'r', st.r, 1, rpm, cur, k, g, now, st.cell))
    end
    if tpm >= 0 and st.t + tokens > tpm then
      refuse(i, 2, wait_for(w, 't', st.t, tokens, tpm, cur, k, g, now, st.cell))
    end
  end
  if conc >= 0 then
    local live = redis.call('ZCARD', c)
    if live >= conc then
      live = live - redis.call('ZREMRANGEBYSCORE', c, '-inf', now)
    end
    lives[i] = live
    if live >= conc then
      local first = redis.call('ZRANGE', c, 0, 0, 'WITHSCORES')
      local wait = hint
      if first[2] and tonumber(first[2]) - now < wait then
        wait = tonumber(first[2]) - now
      end
      refuse(i, 3, wait)
    end
  end
end
if worst_dim > 0 then
  if #backs > 0 then
    -- Refused, but the refunds it carried are given back.
    for i = 0, n - 1 do
      if windows[i] then
        write(KEYS[3 * i + 1], windows[i], cur, k, g)
      end
    end
  end
  return {0, now, worst_scope, worst_dim, worst_wait}
end

for i = 0, n - 1 do
  local w, c = KEYS[3 * i + 1], KEYS[3 * i + 2]
  local rpm = tonumber(ARGV[9 + 3 * i])
  local tpm = tonumber(ARGV[10 + 3 * i])
  local st = windows[i]
  -- The lease zset's TTL (two lease TTLs) is renewed once less than one is left, as
  -- noted in the scope's window hash ('ce'; every PEXPIRE of the zset sets it to end
  -- two lease TTLs from then, so the zset never ends before its noted end), or on a
  -- zset this admission creates; without a window hash, as its PTTL says. Never
  -- shortened: the limiters sharing a scope (an account's sources) may lease for
  -- longer than this one, and a zset ending early would take their live leases.
  -- renew.lua extends a zset without noting it here (it does not touch the window
  -- hash), so 'ce' may be earlier than the zset's end: before renewing a zset that
  -- holds leases, its PTTL is read (about once per lease TTL), and an end later than
  -- two of this admission's TTLs is kept and noted instead.
  local lease_here = lease ~= '' and tonumber(ARGV[11 + 3 * i]) >= 0
  local renew_c = false
  local c_end = now + 2 * ttl
  if lease_here then
    if st then
      renew_c = lives[i] == 0 or st.ce - now < ttl
      if renew_c and lives[i] > 0 then
        local left = redis.call('PTTL', c)
        if left > 2 * ttl then
          c_end = now + left
        end
      end
    else
      -- -1 (no TTL) and -2 (no zset yet) renew too.
      renew_c = redis.call('PTTL', c) < ttl
    end
  end
  if st then
    if rpm >= 0 then add(st, 'r', cur, 1) end
    if tpm >= 0 then add(st, 't', cur, tokens) end
    if renew_c then
      st.cell['ce'] = c_end
      st.dirty['ce'] = true
    end
    write(w, st, cur, k, g)
  end
  if lease_here then
    redis.call('ZADD', c, now + ttl, lease)
    if renew_c and c_end == now + 2 * ttl then
      redis.call('PEXPIRE', c, 2 * ttl)
    end
  end
end

-- What this admission filled (read only then): the next admission would be refused
-- until the wait, unless something this process sees frees it first.
local full_dim, full_scope, full_wait = 0, 0, -1
for i = 0, n - 1 do
  local w, c = KEYS[3 * i + 1], KEYS[3 * i + 2]
  local rpm = tonumber(ARGV[9 + 3 * i])
  local conc = tonumber(ARGV[11 + 3 * i])
  local st = windows[i]
  if st and rpm >= 0 and st.r >= rpm then
    local wait = wait_for(w, 'r', st.r, 1, rpm, cur, k, g, now)
    if wait > full_wait then
      full_dim, full_scope, full_wait = 1, i, wait
    end
  end
  if lease ~= '' and conc >= 0 and lives[i] + 1 >= conc then
    local first = redis.call('ZRANGE', c, 0, 0, 'WITHSCORES')
    local wait = hint
    if first[2] and tonumber(first[2]) - now < wait then
      wait = tonumber(first[2]) - now
    end
    if wait > full_wait then
      full_dim, full_scope, full_wait = 3, i, wait
    end
  end
end
local out = {1, now, math.floor(now / wms), full_scope, full_dim, full_wait}
for i = 0, n - 1 do
  local rpm = tonumber(ARGV[9 + 3 * i])
  local conc = tonumber(ARGV[11 + 3 * i])
  local room = nil
  local st = windows[i]
  if st and rpm >= 0 then
    room = rpm - st.r
  end
  if lease ~= '' and conc >= 0 and (room == nil or conc - lives[i] - 1 < room) then
    room = conc - lives[i] - 1
  end
  if room == nil then
    room = -1
  elseif room < 0 then
    room = 0
  end
  out[#out + 1] = room
end
return out

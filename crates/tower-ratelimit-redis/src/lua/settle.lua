-- Settles one admission after the call, one round trip. Prepended with window.lua.
-- Tokens reserved and not used (or the request and its tokens, when the call was not
-- admitted below) go back to the sub-window of admission, while it is still kept;
-- tokens used beyond the estimate are charged to the sub-window the settle lands in
-- (server clock), so they count in every span from now on. The lease is released.
--
-- KEYS, two per scope: w (window hash), c (lease zset); then, for a settle without a
--   lease that gives something back on a cluster, a marker unique to this settle (same
--   hash tag): its SET NX tells a second run of the script, as a lease's ZREM does.
-- ARGV: nscopes, sub_ms, subs, admitted_ms, delta_requests, delta_tokens,
--       lease_id ('' = none), then per scope: rpm, tpm, concurrency (-1 = unlimited),
--       then m and m pairs (admitted_ms, tokens < 0): token refunds of earlier settles
--       that the process deferred (their leases went by ZREM), given back to each
--       scope with a tpm whatever this settle's lease says.
-- Returns 1, or 2 when a refund was not given back because the lease was gone.
-- Only what a scope limits is touched; the clock is read only when a count changes.
-- Applied once: a settle whose lease is already gone gives nothing back (see below).
local n = tonumber(ARGV[1])
local g = tonumber(ARGV[2])
local k = tonumber(ARGV[3])
local at = math.floor(tonumber(ARGV[4]) / g)
local dr = tonumber(ARGV[5])
local dt = tonumber(ARGV[6])
local lease = ARGV[7]
local backs, ats = carried(8 + 3 * n, g)
ats[#ats + 1] = at
-- The lease is released first. A settle that finds it in none of the zsets that should
-- hold it was already applied (a cluster client resends a script whose answer it lost)
-- or its lease expired and was purged: what it gives back is not given back again (a
-- second refund would count another call's request or tokens out), what it charges is
-- charged (counted twice at worst, never under).
local leased, held = false, false
local marker = KEYS[2 * n + 1]
if lease ~= '' then
  for i = 0, n - 1 do
    if tonumber(ARGV[10 + 3 * i]) >= 0 then
      leased = true
      if redis.call('ZREM', KEYS[2 * i + 2], lease) == 1 then
        held = true
      end
    end
  end
elseif marker then
  -- Kept for 30 s (or the window, when shorter): a cluster client resends a script
  -- within its response timeout and retry, seconds; a marker per settle kept for a
  -- long window (a daily quota) would pile up on the scope's node.
  leased = true
  if redis.call('SET', marker, 1, 'NX', 'PX', math.min(g * k, 30000)) then
    held = true
  end
end
local dropped = 0
if leased and not held then
  if dr < 0 or dt < 0 then dropped = 1 end
  if dr < 0 then dr = 0 end
  if dt < 0 then dt = 0 end
end
local cur
for i = 0, n - 1 do
  local w = KEYS[2 * i + 1]
  local r = 0
  local tk = 0
  if tonumber(ARGV[8 + 3 * i]) >= 0 then r = dr end
  local tpm = tonumber(ARGV[9 + 3 * i]) >= 0
  if tpm then tk = dt end
  if r ~= 0 or tk ~= 0 or (tpm and #backs > 0) then
    if not cur then
      local t = redis.call('TIME')
      cur = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) / g)
    end
    local st = read(w, cur, k, ats)
    if r < 0 then back(st, 'r', at, r) end
    if tk < 0 then back(st, 't', at, tk) end
    if tpm then
      give_back(st, backs)
    end
    if r > 0 then add(st, 'r', cur, r) end
    if tk > 0 then add(st, 't', cur, tk) end
    write(w, st, cur, k, g)
  end
end
return 1 + dropped

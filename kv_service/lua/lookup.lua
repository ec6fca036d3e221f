-- ARGV: pre, hash length L, the chain: n hashes of L bytes concatenated in one string (one argument
-- instead of n: Redis turns each argument into a Lua string, the client encodes each).
-- Returns {device, union}, each {k, "num,num,...", k, "num,...", ...}: every holder of the chain's
-- first block (worker numbers, live or not: store_redis.py keeps the live workers of the model, read in
-- the same transaction) by how many leading blocks of the chain it holds on its device; and, while any
-- worker of the shard holds host-tier blocks, each worker with a device answer above 0 or host block 0
-- by how far its host tier continues that answer (the device answer plus the continuation; empty
-- while no worker of the shard holds a host-tier block).
-- Writes nothing (it runs on replicas: EVALSHA_RO).
--
-- NOTE: no walk down the chain. Each worker's match is found by the binary search of
-- kvmesh.kv_service.prefix_search.held_prefix (block 0, then over [1, n]; exact while the worker's
-- blocks are prefix-closed, docs/kv-service.md "Lookup"); a probe is one block's holder string.
-- Workers that agreed on every probe so far form a group and share the next probe, so one HMGET per
-- round probes every group (~log2(n) rounds). A group splits only where a probe's holders differ
-- from both strings its members are known by: of a block they all hold (lo - 1) and of one none of
-- them holds (hi); strings are interned, so == is a pointer test.
local L, chain = tonumber(ARGV[2]), ARGV[3]
local n = #chain / L
if n == 0 then return {{}, {}} end
local function block(i) return string.sub(chain, i * L + 1, (i + 1) * L) end
local function midpoint(lo, hi) local m = (lo + hi + 1) / 2 return m - m % 1 end

-- round 1: block 0 (who holds any of the chain) and, speculatively, the first midpoint
local probe = {block(0)}
if n > 1 then probe[2] = block(midpoint(1, n) - 1) end
local got = redis.call('HMGET', BH, unpack(probe))
local h0 = got[1]
-- NOTE: the host tier's continuation runs only while a worker of this shard holds host-tier blocks.
local tiered = redis.call('EXISTS', HH) == 1
local hh0 = tiered and redis.call('HGET', HH, probe[1]) or false
if not h0 and not hh0 then return {{}, {}} end
-- NOTE: the answer comes by group: {k, "num,num,..."}: one string per group instead of two values
-- per worker (each value of a script's reply costs Redis a conversion; 128 holders cost ~30 us).
local out, uout = {}, {}
local function answer(k, members)
  out[#out + 1] = k
  out[#out + 1] = table.concat(members, ',')
end
local members = {}
for num in string.gmatch(h0 or '', '%d+') do members[#members + 1] = num end

-- Splits `members` by a holder string: a few members are found in it, many look it up as a set
-- (parsed once per distinct string).
local sets = {}
local function split(v, mem)
  local right, left = {}, {}
  if #mem <= 16 then
    for _, num in ipairs(mem) do
      if string.find(v, ',' .. num .. ',', 1, true) then right[#right + 1] = num else left[#left + 1] = num end
    end
  else
    local set = sets[v]
    if not set then
      set = {}
      for num in string.gmatch(v, '%d+') do set[num] = true end
      sets[v] = set
    end
    for _, num in ipairs(mem) do
      if set[num] then right[#right + 1] = num else left[#left + 1] = num end
    end
  end
  return right, left
end

-- One round of a group search: the probe value v of each group's midpoint splits its members into
-- those holding it (right) and those not (left); a group of one block answers. Returns the next groups.
local function step(groups, probed, answered)
  local next_open = {}
  for g = 1, #groups do
    local lo, hi, mem, slo, shi = groups[g][1], groups[g][2], groups[g][3], groups[g][4], groups[g][5]
    local mid = midpoint(lo, hi)
    local v = probed[g]
    local right, left
    if not v or v == shi then
      left = mem
    elseif v == slo then
      right = mem
    else
      right, left = split(v, mem)
    end
    if right and #right > 0 then
      if mid < hi then next_open[#next_open + 1] = {mid, hi, right, v, shi} else answered(mid, right) end
    end
    if left and #left > 0 then
      if lo < mid - 1 then next_open[#next_open + 1] = {lo, mid - 1, left, slo, v} else answered(lo, left) end
    end
  end
  return next_open
end

-- the blocks each group probes next (their midpoints)
local function probes(groups)
  local keys = {}
  for g = 1, #groups do keys[g] = block(midpoint(groups[g][1], groups[g][2]) - 1) end
  return keys
end

-- a group: {lo, hi, members, holders of block lo - 1, holders of block hi (false: none, or hi = n)}
local open, vals = {{1, n, members, h0, false}}, {got[2]}
if #members == 0 then
  open = {}
elseif n == 1 then
  answer(1, members)
  open = {}
end
while #open > 0 do
  open = step(open, vals, answer)
  if #open == 0 then break end
  vals = redis.call('HMGET', BH, unpack(probes(open)))
end
if not tiered then return {out, uout} end

-- The host tier's continuation (kvmesh.kv_service.prefix_search.continue_prefixes): the same search
-- over the host tier's holder strings (HH), from each device answer k to n, and from 1 for the workers
-- holding block 0 in their host tier only. UNKNOWN marks a string not read (a group's start): it equals
-- no string.
local UNKNOWN = {}
local function uanswer(k, mem)
  uout[#uout + 1] = k
  uout[#uout + 1] = table.concat(mem, ',')
end
-- a group: as the device search's, over HH
open = {}
for i = 1, #out, 2 do
  local mem = {}
  for num in string.gmatch(out[i + 1], '%d+') do mem[#mem + 1] = num end
  if out[i] == n then uanswer(n, mem) else open[#open + 1] = {out[i], n, mem, UNKNOWN, false} end
end
if hh0 then
  local dev = h0 or ''
  local mem = {}
  for num in string.gmatch(hh0, '%d+') do
    if not string.find(dev, ',' .. num .. ',', 1, true) then mem[#mem + 1] = num end
  end
  if #mem > 0 then
    if n == 1 then uanswer(1, mem) else open[#open + 1] = {1, n, mem, hh0, false} end
  end
end
while #open > 0 do
  open = step(open, redis.call('HMGET', HH, unpack(probes(open))), uanswer)
end
return {out, uout}

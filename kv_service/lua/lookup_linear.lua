-- ARGV: pre, model, now, hash length L, the chain: n hashes of L bytes concatenated in one string
-- (one argument instead of n: Redis turns each argument into a Lua string, the client encodes each).
-- Returns {live worker ids, {wid, matched, wid, matched, ...} for workers with matched > 0, each live
-- worker's pending picks "picks,prefill,blocks,version" (false: none ever), each live worker's
-- "addr|block_size|load", {wid, reach, ...}: how far each worker's host tier continues its device match
-- (walked on from it; only while a worker holds host-tier blocks)}.
local now = ARGV[3]
local live = redis.call('ZRANGEBYSCORE', pre .. 'mw:' .. ARGV[2], '(' .. now, '+inf')
if #live == 0 then return {live, {}, {}, {}, {}} end
local nums = redis.call('HMGET', pre .. 'wn', unpack(live))
local tags, cand, matched = {}, {}, {}
for j = 1, #live do
  if nums[j] then
    tags[j] = ',' .. nums[j] .. ','
    cand[#cand + 1] = j
  end
end
-- NOTE: the chain's holder strings come 64 at a time (one HMGET each); the walk stops at the
-- first block no remaining candidate holds, so a miss early in a long chain costs one call.
-- Consecutive blocks usually have the same holders, hence the same (interned) Lua string: the
-- candidates are re-filtered only when the string changes; `depth` is how far the current
-- candidates have matched, recorded for each candidate when it drops out.
local WINDOW = 64
local L, chain = tonumber(ARGV[4]), ARGV[5]
local n = #chain / L
local depth, prev = 0, nil
local c = 1
while c <= n and #cand > 0 do
  local e = math.min(n, c + WINDOW - 1)
  local window = {}
  for i = c, e do window[i - c + 1] = string.sub(chain, (i - 1) * L + 1, i * L) end
  local holders = redis.call('HMGET', BH, unpack(window))
  for k = 1, e - c + 1 do
    local v = holders[k]
    if v ~= prev then
      local next_cand = {}
      for _, j in ipairs(cand) do
        if v and string.find(v, tags[j], 1, true) then
          next_cand[#next_cand + 1] = j
        else
          matched[j] = depth
        end
      end
      cand, prev = next_cand, v
      if #cand == 0 then break end
    end
    depth = c - 1 + k
  end
  c = e + 1
end
for _, j in ipairs(cand) do matched[j] = depth end
local pairs_out = {}
for j, wid in ipairs(live) do
  if matched[j] and matched[j] > 0 then
    pairs_out[#pairs_out + 1] = wid
    pairs_out[#pairs_out + 1] = matched[j]
  end
end
-- The host tier's continuation, walked per worker from its device match to the first block its host
-- tier misses (the baseline of lookup.lua's continuation search).
local reach_out = {}
if n > 0 and redis.call('EXISTS', HH) == 1 then
  local hh0 = redis.call('HGET', HH, string.sub(chain, 1, L)) or ''
  for j, wid in ipairs(live) do
    local tag = tags[j]
    local k = matched[j] or 0
    -- NOTE: a worker without a device match walks only if its host tier holds block 0
    local go = tag ~= nil and (k > 0 or string.find(hh0, tag, 1, true) ~= nil)
    while go and k < n do
      local e = math.min(n, k + WINDOW)
      local window = {}
      for i = k + 1, e do window[#window + 1] = string.sub(chain, (i - 1) * L + 1, i * L) end
      local h = redis.call('HMGET', HH, unpack(window))
      for w = 1, #window do
        if h[w] and string.find(h[w], tag, 1, true) then
          k = k + 1
        else
          go = false
          break
        end
      end
    end
    if k > (matched[j] or 0) then
      reach_out[#reach_out + 1] = wid
      reach_out[#reach_out + 1] = k
    end
  end
end
return {live, pairs_out, redis.call('HMGET', pre .. 'pd:' .. ARGV[2], unpack(live)),
        redis.call('HMGET', pre .. 'ld:' .. ARGV[2], unpack(live)), reach_out}

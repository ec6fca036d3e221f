-- ARGV: pre, model, now, h1..hn.
-- Returns {live worker ids, {wid, matched, wid, matched, ...} for workers with matched > 0}.
-- Addresses and loads are not read here: the store keeps them in a cache refreshed in the
-- background (kv_service/store_redis.py), which halves the script's work with 64 workers.
local now = ARGV[3]
local live = redis.call('ZRANGEBYSCORE', pre .. 'mw:' .. ARGV[2], '(' .. now, '+inf')
if #live == 0 then return {live, {}} end
local n = #ARGV - 3
local matched = {}
local cand = live
local i = 1
-- Block-major while many workers are still in the race: one SMISMEMBER per block over the
-- surviving candidates; the walk stops at the first block no candidate holds.
while i <= n and #cand > 4 do
  local hits = redis.call('SMISMEMBER', pre .. 'b:' .. ARGV[3 + i], unpack(cand))
  local next_cand = {}
  for j, hit in ipairs(hits) do
    if hit == 1 then
      next_cand[#next_cand + 1] = cand[j]
      matched[cand[j]] = i
    end
  end
  cand = next_cand
  i = i + 1
end
-- Worker-major for the few left: one ZMSCORE per worker over the rest of the chain.
-- NOTE: both walks give the same answer (leading blocks held); this one makes fewer calls
-- once few candidates remain, which is the common case past a shared system prompt.
if i <= n then
  for _, wid in ipairs(cand) do
    local scores = redis.call('ZMSCORE', pre .. 'l:' .. wid, unpack(ARGV, 3 + i, 3 + n))
    local k = 0
    while k < #scores and scores[k + 1] do k = k + 1 end
    matched[wid] = i - 1 + k
  end
end
local pairs_out = {}
for _, wid in ipairs(live) do
  local m = matched[wid]
  if m and m > 0 then
    pairs_out[#pairs_out + 1] = wid
    pairs_out[#pairs_out + 1] = m
  end
end
return {live, pairs_out}

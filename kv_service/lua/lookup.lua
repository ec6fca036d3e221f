-- ARGV: pre, model, now, h1..hn. Returns flat: wid, matched, addr, load, bs per live worker.
local now = ARGV[3]
local live = redis.call('ZRANGEBYSCORE', pre .. 'mw:' .. ARGV[2], '(' .. now, '+inf')
if #live == 0 then return {} end
local matched = {}
for _, wid in ipairs(live) do matched[wid] = 0 end
local cand = live
for i = 4, #ARGV do
  -- NOTE: one SMISMEMBER per block over the surviving candidates: O(candidates), however many
  -- workers hold the block; the walk stops at the first block no candidate holds.
  local hits = redis.call('SMISMEMBER', pre .. 'b:' .. ARGV[i], unpack(cand))
  local next_cand = {}
  for j, hit in ipairs(hits) do
    if hit == 1 then
      next_cand[#next_cand + 1] = cand[j]
      matched[cand[j]] = i - 3
    end
  end
  if #next_cand == 0 then break end
  cand = next_cand
end
local out = {}
for _, wid in ipairs(live) do
  local info = redis.call('HMGET', pre .. 'w:' .. wid, 'addr', 'load', 'bs')
  out[#out + 1] = wid
  out[#out + 1] = matched[wid]
  out[#out + 1] = info[1]
  out[#out + 1] = info[2]
  out[#out + 1] = info[3]
end
return out

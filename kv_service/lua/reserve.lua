-- ARGV: pre, wid, model, router, request id, prefill, blocks, seen ('' = unconditional), now, ttl cutoff, max picks
-- Returns {'OK'} | {'CONFLICT'} (another router reserved the worker after version `seen`) |
-- {'NOT_FOUND'} (not a live worker of the model).
local wid, model, router, rid = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now, ttl_cut, max_picks = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local w, err = live_worker(wid, now)
if err or w[5] ~= model then return {'NOT_FOUND'} end
local pk = pre .. 'pk:' .. wid
if ARGV[8] ~= '' then
  local seen = tonumber(ARGV[8])
  for _, v in ipairs(redis.call('HVALS', pk)) do
    local t, r, ver = pick_fields(v)
    -- NOTE: a pick past its TTL conflicts with nobody.
    if ver > seen and r ~= router and t > ttl_cut then return {'CONFLICT'} end
  end
end
local ver = redis.call('HINCRBY', pre .. 'w:' .. wid, 'pv', 1)
redis.call('HSET', pk, rid, now .. ',' .. router .. ',' .. ver .. ',' .. ARGV[6] .. ',' .. ARGV[7])
local over = redis.call('HLEN', pk) - max_picks
if over > 0 then
  -- NOTE: past the bound the oldest go (a router that never forwards cannot grow the store).
  local flat, order = redis.call('HGETALL', pk), {}
  for i = 1, #flat, 2 do order[#order + 1] = {pick_fields(flat[i + 1]), flat[i]} end
  table.sort(order, function(a, b) return a[1] < b[1] end)
  for i = 1, over do redis.call('HDEL', pk, order[i][2]) end
end
settle_picks(wid, model, function(t, _) return t <= ttl_cut end)
return {'OK'}

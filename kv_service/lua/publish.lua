-- ARGV: pre, wid, epoch, seq, now, snapshot(0/1), then
--   snapshot: the hashes (oldest first);
--   events:   a sequence of 'S' n h1..hn | 'R' n h1..hn | 'C'.
local wid, epoch, seq = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now, snapshot = tonumber(ARGV[5]), ARGV[6] == '1'
local w, err = live_worker(wid, now)
if err then return err end
local cur, last = tonumber(w[1]), tonumber(w[2])
if epoch < cur then return {'STALE_EPOCH', w[1]} end
if epoch == cur and seq <= last then return {'SEQ_REGRESSION', w[2]} end
if not snapshot then
  if epoch > cur then return {'RESYNC', 'new epoch ' .. ARGV[3] .. ' (live epoch ' .. w[1] .. ')'} end
  if seq ~= last + 1 then
    return {'RESYNC', 'seq gap: expected ' .. string.format('%d', last + 1) .. ', got ' .. ARGV[4]}
  end
end
local wkey = pre .. 'w:' .. wid
local num = w[8]
if snapshot then
  clear_worker(wid, num)
  add_blocks(wid, num, ARGV, 7, #ARGV)
  redis.call('HSET', wkey, 'epoch', ARGV[3])
else
  local i = 7
  while i <= #ARGV do
    local op = ARGV[i]
    if op == 'C' then
      clear_worker(wid, num)
      i = i + 1
    else
      local n = tonumber(ARGV[i + 1])
      if op == 'S' then
        add_blocks(wid, num, ARGV, i + 2, i + 1 + n)
      else
        drop_blocks(wid, num, ARGV, i + 2, i + 1 + n)
      end
      i = i + 2 + n
    end
  end
end
cap_worker(wid, num, tonumber(w[4]))
redis.call('HSET', wkey, 'seq', ARGV[4])
return {'OK'}

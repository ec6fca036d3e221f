-- ARGV: pre, wid, epoch, seq, now, snapshot(0/1), part, last(0/1), load ('' = unchanged), cover
--   (the picks the load covers, common.lua cover_picks; '' = none), then a sequence of
--   'S' hashes | 'R' hashes (the device tier) | 'HS' hashes | 'HR' hashes (the host tier) | 'C' (both)
--   (hashes: one string, split_hashes). A snapshot clears the worker at part 0 and stores its blocks
--   ('S', 'HS', each oldest first).
-- NOTE: one batch may come in parts 0..k (store_redis.py bounds the hashes per call, so Redis is
-- never busy with one batch for long while Lookups wait). Part 0 checks the order (a snapshot
-- also clears the worker and adopts the epoch); a later part applies only if the worker's pending
-- (pseq, ppart) names it; the last part commits seq. Between parts the index holds the worker's
-- state after a prefix of its event stream, which is a state the worker really was in.
local wid, epoch, seq = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now, snapshot = tonumber(ARGV[5]), ARGV[6] == '1'
local part, last, load = tonumber(ARGV[7]), ARGV[8] == '1', ARGV[9]
local w, err = live_worker(wid, now)
if err then return err end
local cur, lastseq = tonumber(w[1]), tonumber(w[2])
local wkey = pre .. 'w:' .. wid
local num = w[8]
if part == 0 then
  if epoch < cur then return {'STALE_EPOCH', w[1]} end
  if epoch == cur and seq <= lastseq then return {'SEQ_REGRESSION', w[2]} end
  if not snapshot then
    if epoch > cur then return {'RESYNC', 'new epoch ' .. ARGV[3] .. ' (live epoch ' .. w[1] .. ')'} end
    if seq ~= lastseq + 1 then
      return {'RESYNC', 'seq gap: expected ' .. string.format('%d', lastseq + 1) .. ', got ' .. ARGV[4]}
    end
    if redis.call('HEXISTS', wkey, 'resync') == 1 then return {'RESYNC', FLUSHED} end
  else
    clear_worker(wid, num)
    -- NOTE: settled at part 0, which clears the worker: a flush between two parts asks again.
    redis.call('HDEL', wkey, 'resync')
    redis.call('HSET', wkey, 'epoch', ARGV[3])
  end
else
  local p = redis.call('HMGET', wkey, 'pseq', 'ppart')
  if epoch ~= cur or p[1] ~= ARGV[4] or tonumber(p[2]) ~= part then
    return {'RESYNC', 'part ' .. ARGV[7] .. ' of batch ' .. ARGV[4] .. ' arrived out of order'}
  end
end
local i = 11
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    clear_worker(wid, num)
    i = i + 1
  else
    local hashes = split_hashes(ARGV[i + 1])
    local host = op == 'HS' or op == 'HR'
    if op == 'S' or op == 'HS' then
      add_blocks(wid, num, hashes, 1, #hashes, host)
    else
      drop_blocks(wid, num, hashes, 1, #hashes, host)
    end
    i = i + 2
  end
end
-- NOTE: a worker registered before tiers has no host cap: 8 x its device's (index_protocol.UNDECLARED_HOST_FACTOR).
cap_worker(wid, num, tonumber(w[4]), tonumber(w[9]) or 8 * tonumber(w[4]))
if last then
  redis.call('HSET', wkey, 'seq', ARGV[4])
  redis.call('HDEL', wkey, 'pseq', 'ppart')
  -- NOTE: the load rides with the batch (one round trip); the lease stays the heartbeat's.
  if load ~= '' then set_load(wid, w, load, ARGV[10]) end
else
  redis.call('HSET', wkey, 'pseq', ARGV[4], 'ppart', part + 1)
end
return {'OK'}

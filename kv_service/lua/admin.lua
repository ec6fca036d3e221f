-- ARGV: pre, op, ...
--   holders h now        -> live holder ids
--   flush wid            -> {'OK', n} | {'NOT_FOUND'}; the worker then owes a snapshot ('resync')
--   reap now             -> number of workers removed
local op = ARGV[2]
if op == 'holders' then
  local now = tonumber(ARGV[4])
  local out = {}
  local v = redis.call('HGET', BH, ARGV[3])
  if v then
    for num in string.gmatch(v, '(%d+)') do
      local wid = redis.call('HGET', pre .. 'nw', num)
      local lease = wid and redis.call('ZSCORE', pre .. 'workers', wid)
      if lease and tonumber(lease) > now then out[#out + 1] = wid end
    end
  end
  return out
elseif op == 'flush' then
  local num = redis.call('HGET', pre .. 'w:' .. ARGV[3], 'num')
  if not num then return {'NOT_FOUND'} end
  -- NOTE: heartbeats answer resync and event batches RESYNC until the worker's snapshot arrives;
  -- the parts still pending of a split batch no longer apply (they answer RESYNC too).
  redis.call('HSET', pre .. 'w:' .. ARGV[3], 'resync', 1)
  redis.call('HDEL', pre .. 'w:' .. ARGV[3], 'pseq', 'ppart')
  return {'OK', clear_worker(ARGV[3], num)}
elseif op == 'reap' then
  local dead = redis.call('ZRANGEBYSCORE', pre .. 'workers', '-inf', ARGV[3])
  for _, wid in ipairs(dead) do
    local w = redis.call('HMGET', pre .. 'w:' .. wid, 'model', 'num')
    remove_worker(wid, w[1], w[2])
  end
  return #dead
end
return redis.error_reply('unknown admin op ' .. tostring(op))

-- ARGV: pre, op, ...
--   holders h now        -> live holder ids
--   flush wid            -> {'OK', n} | {'NOT_FOUND'}
--   reap now             -> number of workers removed
local op = ARGV[2]
if op == 'holders' then
  local now = tonumber(ARGV[4])
  local out = {}
  for _, wid in ipairs(redis.call('SMEMBERS', pre .. 'b:' .. ARGV[3])) do
    local lease = redis.call('ZSCORE', pre .. 'workers', wid)
    if lease and tonumber(lease) > now then out[#out + 1] = wid end
  end
  return out
elseif op == 'flush' then
  if redis.call('EXISTS', pre .. 'w:' .. ARGV[3]) == 0 then return {'NOT_FOUND'} end
  return {'OK', clear_worker(ARGV[3])}
elseif op == 'reap' then
  local dead = redis.call('ZRANGEBYSCORE', pre .. 'workers', '-inf', ARGV[3])
  for _, wid in ipairs(dead) do
    remove_worker(wid, redis.call('HGET', pre .. 'w:' .. wid, 'model'))
  end
  return #dead
end
return redis.error_reply('unknown admin op ' .. tostring(op))

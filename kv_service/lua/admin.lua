-- ARGV: pre, op, ... (one shard of the index: store_redis.py asks every shard and merges)
--   holders h now tier    -> live holder ids on this shard, of the device tier ('') or the host tier ('h')
--   flush wid             -> {'OK', n} | {'NOT_FOUND'}; the worker then owes a snapshot ('resync')
--   reap now              -> number of workers removed
--   workers               -> per registered worker: wid, model, addr, bs, algo, nb, epoch, seq, load,
--                            lease, engine, host blocks declared, pending picks, device blocks indexed,
--                            host blocks indexed, role (16 values each, flat)
--   pending model         -> the model's workers' pending picks here: wid, "picks,prefill,blocks,version", ...
--   spec model            -> {bs, algo, the latest lease of its workers here (0: none)} | {}
--   livespec model now wid -> {bs, algo} if a worker of the model other than wid is live here | {}
--   unregister wid epoch  -> 1 if the worker was registered with that epoch and is now removed, else 0
--   release wid rid       -> drops the request's pending pick of the worker (a folded reservation the
--                            router's pick moved away from): 1 if it was there, else 0
local op = ARGV[2]
if op == 'holders' then
  local now = tonumber(ARGV[4])
  local out = {}
  local v = redis.call('HGET', ARGV[5] == 'h' and HH or BH, ARGV[3])
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
elseif op == 'workers' then
  -- NOTE: one script instead of a pipeline of two reads per worker: atomic per shard, one round.
  local out = {}
  for _, wid in ipairs(redis.call('ZRANGE', pre .. 'workers', 0, -1)) do
    local h = redis.call('HMGET', pre .. 'w:' .. wid, 'model', 'addr', 'bs', 'algo', 'nb', 'epoch', 'seq', 'load', 'lease',
      'engine', 'hb')
    if h[1] then
      out[#out + 1] = wid
      for i = 1, 11 do out[#out + 1] = h[i] or '' end
      out[#out + 1] = redis.call('HGET', pre .. 'pd:' .. h[1], wid) or ''
      out[#out + 1] = redis.call('ZCARD', pre .. 'l:' .. wid)
      out[#out + 1] = redis.call('ZCARD', pre .. 'hl:' .. wid)
      out[#out + 1] = redis.call('HGET', pre .. 'w:' .. wid, 'role') or ''
    end
  end
  return out
elseif op == 'pending' then
  return redis.call('HGETALL', pre .. 'pd:' .. ARGV[3])
elseif op == 'spec' then
  local s = redis.call('HMGET', pre .. 'm:' .. ARGV[3], 'bs', 'algo')
  if not s[1] then return {} end
  local last = redis.call('ZRANGE', pre .. 'mw:' .. ARGV[3], -1, -1, 'WITHSCORES')
  return {s[1], s[2], last[2] or '0'}
elseif op == 'livespec' then
  local peers = redis.call('ZRANGEBYSCORE', pre .. 'mw:' .. ARGV[3], '(' .. ARGV[4], '+inf')
  for _, p in ipairs(peers) do
    if p ~= ARGV[5] then return redis.call('HMGET', pre .. 'm:' .. ARGV[3], 'bs', 'algo') end
  end
  return {}
elseif op == 'unregister' then
  local w = redis.call('HMGET', pre .. 'w:' .. ARGV[3], 'model', 'num', 'epoch')
  if w[1] and w[3] == ARGV[4] then
    remove_worker(ARGV[3], w[1], w[2])
    return 1
  end
  return 0
elseif op == 'release' then
  local model = redis.call('HGET', pre .. 'w:' .. ARGV[3], 'model')
  if not model or redis.call('HEXISTS', pre .. 'pk:' .. ARGV[3], ARGV[4]) == 0 then return 0 end
  local rid = ARGV[4]
  settle_picks(ARGV[3], model, function(_, r) return r == rid end)
  return 1
end
return redis.error_reply('unknown admin op ' .. tostring(op))

-- ARGV: pre, wid, addr, model, bs, algo, nb, epoch, now, ttl, engine, hb (the host tier's blocks as
-- declared, 0 = none), hnb (the host tier's cap in the index), role (prefill, decode or both)
local wid, addr, model, bs, algo, nb, epoch = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local now, ttl = tonumber(ARGV[9]), tonumber(ARGV[10])
local mkey = pre .. 'm:' .. model
local spec = redis.call('HMGET', mkey, 'bs', 'algo')
if spec[1] and (spec[1] ~= bs or spec[2] ~= algo) then
  local peers = redis.call('ZRANGEBYSCORE', pre .. 'mw:' .. model, '(' .. now, '+inf')
  for _, p in ipairs(peers) do
    if p ~= wid then return {'SPEC', spec[1], spec[2]} end
  end
end
local wkey = pre .. 'w:' .. wid
local old = redis.call('HMGET', wkey, 'model', 'epoch', 'lease', 'num', 'pv')
if old[1] then
  if tonumber(old[3]) > now then
    if old[1] ~= model then return {'MODEL', old[1]} end
    if tonumber(old[2]) > tonumber(epoch) then return {'EPOCH', old[2]} end
  end
  remove_worker(wid, old[1], old[4])
end
-- A worker's number tags it in the holders hash; a new one per registration.
local num = redis.call('INCR', pre .. 'wseq')
redis.call('HSET', pre .. 'wn', wid, num)
redis.call('HSET', pre .. 'nw', num, wid)
redis.call('HSETNX', BH, BH_TABLE_FIELD, BH_TABLE_VALUE)
local lease = now + ttl
redis.call('HSET', mkey, 'bs', bs, 'algo', algo)
redis.call('SADD', pre .. 'models', model)
redis.call('HSET', wkey, 'model', model, 'addr', addr, 'bs', bs, 'algo', algo, 'nb', nb,
  'epoch', epoch, 'seq', 0, 'ctr', 0, 'load', '', 'lease', lease, 'num', num, 'engine', ARGV[11],
  'hb', ARGV[12], 'hnb', ARGV[13], 'role', ARGV[14],
  -- NOTE: the picks died with the process; their count goes on, so routers' seen versions stay comparable.
  'pv', old[5] or 0)
redis.call('ZADD', pre .. 'mw:' .. model, lease, wid)
redis.call('HSET', pre .. 'ld:' .. model, wid, num .. '|' .. bs .. '||' .. addr)
if old[5] and tonumber(old[5]) > 0 then redis.call('HSET', pre .. 'pd:' .. model, wid, '0,0,0,' .. old[5]) end
redis.call('ZADD', pre .. 'workers', lease, wid)
return {'OK'}

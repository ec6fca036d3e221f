-- ARGV: pre, wid, epoch, load, now, ttl, cover (common.lua cover_picks)
local wid, epoch, load = ARGV[2], ARGV[3], ARGV[4]
local now, ttl = tonumber(ARGV[5]), tonumber(ARGV[6])
local w, err = live_worker(wid, now)
if err then return err end
if w[1] ~= epoch then return {'EPOCH', w[1]} end
local lease = now + ttl
set_load(wid, w, load, ARGV[7])
redis.call('HSET', pre .. 'w:' .. wid, 'lease', lease)
redis.call('ZADD', pre .. 'mw:' .. w[5], lease, wid)
redis.call('ZADD', pre .. 'workers', lease, wid)
-- NOTE: a flushed worker owes a snapshot (admin.lua flush); the answer tells it.
return {'OK', redis.call('HGET', pre .. 'w:' .. wid, 'resync') or '0'}

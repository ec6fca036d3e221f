-- Shared helpers, prepended to every script. ARGV[1] is the key prefix "kvm:{ns}:".
-- NOTE: every key of the index starts with the prefix, whose {ns} hash tag puts the whole index
-- in one Redis Cluster slot, so each script is atomic on a cluster too.
local pre = ARGV[1]

-- NOTE: Redis deletes a set when its last member goes, so a block's entry disappears exactly
-- when its refcount reaches 0. Per block we make one call (SADD / SREM); the worker's LRU zset
-- is updated in chunked multi-member calls: each redis.call from Lua costs a few microseconds.
local CHUNK = 2000

local function release(wid, members)
  for _, h in ipairs(members) do redis.call('SREM', pre .. 'b:' .. h, wid) end
end

-- Removes hashes[first..last] from the worker (those it does not hold are ignored).
local function drop_blocks(wid, hashes, first, last)
  local lkey = pre .. 'l:' .. wid
  for c = first, last, CHUNK do
    redis.call('ZREM', lkey, unpack(hashes, c, math.min(last, c + CHUNK - 1)))
  end
  for i = first, last do redis.call('SREM', pre .. 'b:' .. hashes[i], wid) end
end

local function clear_worker(wid)
  local lkey = pre .. 'l:' .. wid
  local members = redis.call('ZRANGE', lkey, 0, -1)
  release(wid, members)
  redis.call('DEL', lkey)
  return #members
end

-- Stores hashes[first..last] (oldest first) as the worker's most recently used blocks.
local function add_blocks(wid, hashes, first, last)
  if last < first then return end
  local lkey = pre .. 'l:' .. wid
  local base = redis.call('HINCRBY', pre .. 'w:' .. wid, 'ctr', last - first + 1) - (last - first)
  for c = first, last, CHUNK do
    local args = {}
    for i = c, math.min(last, c + CHUNK - 1) do
      args[#args + 1] = base + i - first
      args[#args + 1] = hashes[i]
    end
    redis.call('ZADD', lkey, unpack(args))
  end
  for i = first, last do redis.call('SADD', pre .. 'b:' .. hashes[i], wid) end
end

local function cap_worker(wid, nb)
  local lkey = pre .. 'l:' .. wid
  local excess = redis.call('ZCARD', lkey) - nb
  if excess > 0 then
    local popped = redis.call('ZPOPMIN', lkey, excess)
    local members = {}
    for i = 1, #popped, 2 do members[#members + 1] = popped[i] end
    release(wid, members)
  end
end

local function remove_worker(wid, model)
  clear_worker(wid)
  redis.call('DEL', pre .. 'w:' .. wid)
  redis.call('ZREM', pre .. 'workers', wid)
  local mw = pre .. 'mw:' .. model
  redis.call('ZREM', mw, wid)
  redis.call('HDEL', pre .. 'ld:' .. model, wid)
  if redis.call('ZCARD', mw) == 0 then
    redis.call('DEL', pre .. 'm:' .. model)
    redis.call('SREM', pre .. 'models', model)
  end
end

-- Returns {epoch, seq, lease, nb, model, addr, bs} if the worker is live, or an error reply.
local function live_worker(wid, now)
  local w = redis.call('HMGET', pre .. 'w:' .. wid, 'epoch', 'seq', 'lease', 'nb', 'model', 'addr', 'bs')
  if not w[1] or tonumber(w[3]) <= now then
    return nil, {'NOT_FOUND', wid}
  end
  return w, nil
end

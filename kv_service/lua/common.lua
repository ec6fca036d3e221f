-- Shared helpers, prepended to every script. ARGV[1] is the key prefix "kvm:{ns}:".
-- NOTE: every key of the index starts with the prefix, whose {ns} hash tag puts the whole index
-- in one Redis Cluster slot, so each script is atomic on a cluster too.
local pre = ARGV[1]

local function drop_block(wid, lkey, h)
  if redis.call('ZREM', lkey, h) == 1 then
    local bkey = pre .. 'b:' .. h
    redis.call('SREM', bkey, wid)
    if redis.call('EXISTS', bkey) == 0 then redis.call('DECR', pre .. 'nblocks') end
  end
end

local function release(wid, members)
  for _, h in ipairs(members) do
    local bkey = pre .. 'b:' .. h
    redis.call('SREM', bkey, wid)
    if redis.call('EXISTS', bkey) == 0 then redis.call('DECR', pre .. 'nblocks') end
  end
end

local function clear_worker(wid)
  local lkey = pre .. 'l:' .. wid
  local members = redis.call('ZRANGE', lkey, 0, -1)
  release(wid, members)
  redis.call('DEL', lkey)
  return #members
end

-- Stores hashes (oldest first) as the most recently used blocks of the worker.
local function add_blocks(wid, hashes, first, last)
  if last < first then return end
  local lkey = pre .. 'l:' .. wid
  local base = redis.call('HINCRBY', pre .. 'w:' .. wid, 'ctr', last - first + 1) - (last - first)
  for i = first, last do
    local h = hashes[i]
    if redis.call('ZADD', lkey, base + i - first, h) == 1 then
      local bkey = pre .. 'b:' .. h
      redis.call('SADD', bkey, wid)
      if redis.call('SCARD', bkey) == 1 then redis.call('INCR', pre .. 'nblocks') end
    end
  end
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
  if redis.call('ZCARD', mw) == 0 then
    redis.call('DEL', pre .. 'm:' .. model)
    redis.call('SREM', pre .. 'models', model)
  end
end

-- Returns the worker's fields if it is live, or an error reply table.
local function live_worker(wid, now)
  local w = redis.call('HMGET', pre .. 'w:' .. wid, 'epoch', 'seq', 'lease', 'nb', 'model')
  if not w[1] or tonumber(w[3]) <= now then
    return nil, {'NOT_FOUND', wid}
  end
  return w, nil
end

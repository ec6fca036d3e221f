-- Shared helpers, prepended to every script. ARGV[1] is the key prefix "kvm:{tag}:" of one shard.
-- NOTE: every key a script touches starts with its shard's prefix, whose {tag} hash tag puts the
-- shard in one Redis Cluster slot, so each script is atomic on a cluster too. A worker lives on
-- one shard (its home): its events are one script there; Lookup runs on every shard.
local pre = ARGV[1]
local BH = pre .. 'bh'
-- The host KV tier's holders, as BH holds the device's (a worker holding a block in both tiers is in both).
local HH = pre .. 'hh'
-- NOTE: one field of BH that is no block hash (its name is not HL bytes long), whose value is longer than
-- Redis's hash-max-listpack-value (64), keeps BH a hash table from the first registration on. A small
-- index (a fresh one: fewer than hash-max-listpack-entries blocks) is otherwise a listpack, which every
-- probe scans field by field: a Lookup's ~8 HMGETs over 250 blocks cost 9 us instead of 1 (issue 45).
-- Redis never turns a hash table back into a listpack. store_redis.py does not count it as a block.
local BH_TABLE_FIELD = 'table'
local BH_TABLE_VALUE = 'keeps this hash a hash table: its fields are block hashes -> ",n1,n2," (docs/kv-service.md)'

-- NOTE: the holders of every block live in ONE hash, field = block hash, value = ",n1,n2,"
-- (the holders' worker numbers). A batch of blocks is then one HMGET + one HSET/HDEL instead
-- of a call per block: each redis.call from Lua costs microseconds, a string.find nanoseconds.
-- A field is deleted when its last holder goes: refcount 0 = no entry; HLEN = distinct blocks.
local CHUNK = 1000

-- The RESYNC reason of a flushed worker's batches (kvmesh.kv_service.index.FLUSHED).
local FLUSHED = "the index dropped this worker's blocks (FlushWorker)"

-- Hashes travel as one string of 16-byte hashes per event (kvmesh.contract.block_hash.HASH_LEN):
-- one argument instead of one per hash, for the client to encode and for Redis to turn into Lua.
local HL = 16
local function split_hashes(blob)
  local t = {}
  for i = 1, #blob, HL do t[#t + 1] = string.sub(blob, i, i + HL - 1) end
  return t
end

-- A tier's keys: the holders hash and the worker's LRU order ('l:' device, 'hl:' host).
local function tier_keys(wid, host)
  if host then return HH, pre .. 'hl:' .. wid end
  return BH, pre .. 'l:' .. wid
end

-- Adds worker `num` to the holders (in hash `bh`) of hashes[first..last].
local function hold(bh, num, hashes, first, last)
  local tag = ',' .. num .. ','
  for c = first, last, CHUNK do
    local e = math.min(last, c + CHUNK - 1)
    local cur = redis.call('HMGET', bh, unpack(hashes, c, e))
    local args = {}
    for i = c, e do
      local v = cur[i - c + 1]
      if not v then
        args[#args + 1] = hashes[i]
        args[#args + 1] = tag
      elseif not string.find(v, tag, 1, true) then
        args[#args + 1] = hashes[i]
        args[#args + 1] = v .. num .. ','
      end
    end
    if #args > 0 then redis.call('HSET', bh, unpack(args)) end
  end
end

-- Removes worker `num` from the holders (in hash `bh`) of hashes[first..last] (absent ones are ignored).
local function unhold(bh, num, hashes, first, last)
  local tag = ',' .. num .. ','
  for c = first, last, CHUNK do
    local e = math.min(last, c + CHUNK - 1)
    local cur = redis.call('HMGET', bh, unpack(hashes, c, e))
    local sets, dels = {}, {}
    for i = c, e do
      local v = cur[i - c + 1]
      if v then
        local s, t = string.find(v, tag, 1, true)
        if s then
          local rest = string.sub(v, 1, s) .. string.sub(v, t + 1)
          if rest == ',' then
            dels[#dels + 1] = hashes[i]
          else
            sets[#sets + 1] = hashes[i]
            sets[#sets + 1] = rest
          end
        end
      end
    end
    if #sets > 0 then redis.call('HSET', bh, unpack(sets)) end
    if #dels > 0 then redis.call('HDEL', bh, unpack(dels)) end
  end
end

-- Drops every block of the worker in both tiers; returns how many (block, tier) entries.
local function clear_worker(wid, num)
  local n = 0
  for _, host in ipairs({false, true}) do
    local bh, lkey = tier_keys(wid, host)
    local members = redis.call('ZRANGE', lkey, 0, -1)
    unhold(bh, num, members, 1, #members)
    redis.call('DEL', lkey)
    n = n + #members
  end
  return n
end

-- Stores hashes[first..last] (oldest first) as the worker's most recently used blocks of a tier
-- (host: its host tier; else its device).
local function add_blocks(wid, num, hashes, first, last, host)
  if last < first then return end
  local bh, lkey = tier_keys(wid, host)
  local base = redis.call('HINCRBY', pre .. 'w:' .. wid, 'ctr', last - first + 1) - (last - first)
  for c = first, last, CHUNK do
    local args = {}
    for i = c, math.min(last, c + CHUNK - 1) do
      args[#args + 1] = base + i - first
      args[#args + 1] = hashes[i]
    end
    redis.call('ZADD', lkey, unpack(args))
  end
  hold(bh, num, hashes, first, last)
end

-- Removes hashes[first..last] from a tier of the worker (those it does not hold are ignored).
local function drop_blocks(wid, num, hashes, first, last, host)
  if last < first then return end
  local bh, lkey = tier_keys(wid, host)
  for c = first, last, CHUNK do
    redis.call('ZREM', lkey, unpack(hashes, c, math.min(last, c + CHUNK - 1)))
  end
  unhold(bh, num, hashes, first, last)
end

-- Evicts the least recently stored blocks of each tier past its cap (nb: device, hnb: host).
local function cap_worker(wid, num, nb, hnb)
  for _, tier in ipairs({{false, nb}, {true, hnb}}) do
    local bh, lkey = tier_keys(wid, tier[1])
    local excess = redis.call('ZCARD', lkey) - tier[2]
    if excess > 0 then
      local popped = redis.call('ZPOPMIN', lkey, excess)
      local members = {}
      for i = 1, #popped, 2 do members[#members + 1] = popped[i] end
      unhold(bh, num, members, 1, #members)
    end
  end
end

local function remove_worker(wid, model, num)
  clear_worker(wid, num)
  redis.call('DEL', pre .. 'w:' .. wid)
  redis.call('DEL', pre .. 'pk:' .. wid)
  redis.call('HDEL', pre .. 'pd:' .. model, wid)
  redis.call('HDEL', pre .. 'wn', wid)
  redis.call('HDEL', pre .. 'nw', num)
  redis.call('ZREM', pre .. 'workers', wid)
  local mw = pre .. 'mw:' .. model
  redis.call('ZREM', mw, wid)
  redis.call('HDEL', pre .. 'ld:' .. model, wid)
  if redis.call('ZCARD', mw) == 0 then
    redis.call('DEL', pre .. 'm:' .. model)
    redis.call('SREM', pre .. 'models', model)
  end
end

-- Returns {epoch, seq, lease, nb, model, addr, bs, num, hnb} if the worker is live, or an error reply
-- (hnb: its host tier's cap; false for a worker registered before tiers).
local function live_worker(wid, now)
  local w = redis.call('HMGET', pre .. 'w:' .. wid, 'epoch', 'seq', 'lease', 'nb', 'model', 'addr', 'bs', 'num',
    'hnb')
  if not w[1] or tonumber(w[3]) <= now then
    return nil, {'NOT_FOUND', wid}
  end
  return w, nil
end

-- The routers' pending picks of a worker (the shared router view, docs/router.md "Several routers"):
--   pk:<wid>   HASH request id -> "taken_ms,router,version,prefill,blocks"
--   pd:<model> HASH wid -> "picks,prefill,blocks,version" (what Lookup reads: one HMGET)
-- and the worker's reservation count in its w: hash ('pv', kept across re-registrations).
local function pick_fields(v)
  local t, r, ver, pf, b = string.match(v, '^([^,]*),(.*),([^,]*),([^,]*),([^,]*)$')
  return tonumber(t), r, tonumber(ver), tonumber(pf), tonumber(b)
end

-- Drops the picks `drop(taken_ms, request id)` says to drop, then writes the worker's sums.
local function settle_picks(wid, model, drop)
  local pk = pre .. 'pk:' .. wid
  local flat = redis.call('HGETALL', pk)
  local dels, n, pf, b = {}, 0, 0, 0
  for i = 1, #flat, 2 do
    local t, _, _, p, k = pick_fields(flat[i + 1])
    if drop(t, flat[i]) then
      dels[#dels + 1] = flat[i]
    else
      n, pf, b = n + 1, pf + p, b + k
    end
  end
  if #dels > 0 then redis.call('HDEL', pk, unpack(dels)) end
  local ver = redis.call('HGET', pre .. 'w:' .. wid, 'pv') or '0'
  redis.call('HSET', pre .. 'pd:' .. model, wid, n .. ',' .. pf .. ',' .. b .. ',' .. ver)
end

-- A report retires the picks it covers. cover: '' (none), or lines "A\n<ttl cutoff>\n<id>..." (the
-- ids of the requests the worker admitted) or "T\n<ttl cutoff>\n<grace cutoff>" (a worker that lists
-- no admissions: the picks taken at or before the grace cutoff); past the TTL a pick goes anyway.
local function cover_picks(wid, model, cover)
  if cover == '' or redis.call('EXISTS', pre .. 'pk:' .. wid) == 0 then return end
  local lines = {}
  for line in string.gmatch(cover, '[^\n]+') do lines[#lines + 1] = line end
  local ttl_cut = tonumber(lines[2])
  if lines[1] == 'A' then
    local ids = {}
    for i = 3, #lines do ids[lines[i]] = true end
    settle_picks(wid, model, function(t, rid) return ids[rid] or t <= ttl_cut end)
  else
    local cut = math.max(ttl_cut, tonumber(lines[3]))
    settle_picks(wid, model, function(t, _) return t <= cut end)
  end
end

-- Records a live worker's load (w: live_worker's answer) where Lookup reads it, with the worker's
-- number, block size and address ("num|bs|load|addr": ld:<model>), and retires the picks the report covers.
local function set_load(wid, w, load, cover)
  redis.call('HSET', pre .. 'w:' .. wid, 'load', load)
  redis.call('HSET', pre .. 'ld:' .. w[5], wid, w[8] .. '|' .. w[7] .. '|' .. load .. '|' .. w[6])
  cover_picks(wid, w[5], cover)
end

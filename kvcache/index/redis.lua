#!lua name=kvmesh_index_@VERSION@
-- kvmesh's shared prefix index as Redis Functions (Redis >= 7, Valkey). The client fills in
-- @VERSION@ (the key layout's version and a digest of this text), so two releases loaded into
-- one server keep their own functions side by side (a rolling upgrade).
--
-- Control keys of one deployment of one model, all in one slot ns = "{k:<8 hex>}":
--   ns.."settings"     HASH  model_id, deployment, block_size, hash_seed (stored once, checked by all)
--   ns.."next"         STRING incarnation counter (replicas' and routers')
--   ns.."replicas"     SET   replica ids with a record
--   ns.."r:"..id       HASH  replica record: address, incarnation, slot, started_at, load...
--   ns.."l:"..id       STRING the replica's LIVE incarnation; its TTL is the heartbeat (a key per
--                            replica, so a replica's ACL user may write its own and no other's)
--   ns.."slots"        HASH  replica id -> the slot of its current incarnation
--   ns.."dead"         HASH  slot -> when (server ms) its incarnation ended (its bits may remain
--                            in block keys until a sweep pass clears them), or -(when it was freed)
--   ns.."routers"      SET   router incarnations that may hold reservations
--   ns.."ri"..rinc     STRING a LIVE router incarnation; its TTL is the router's heartbeat
--   ns.."load"         HASH  replica id -> "<requests> <prefill> <decode>": in-flight requests,
--                            prefill and decode blocks the live routers reserved on it (fleet-wide)
--   ns.."w"..rinc      HASH  "<replica>|n|p|d" -> one router incarnation's share (reaped when it dies)
-- Block keys, in the slot of the chain's first block (its "root"), so one lookup is one call to
-- one shard and different prefixes spread over every shard; prefix = "{<8 hex>.<root's low
-- 16 bits, hex>}":
--   prefix..<8-byte hash>           STRING bitmap: bit s set = the incarnation owning slot s
--                                   published the block (SETBIT; bit 0 is the first byte's MSB)
--                                   in its device tier
--   prefix.."h"..hash               STRING bitmap: the same, for blocks in replicas' host tiers
--   prefix.."~"..(bucket % 2)..hash STRING bitmap: routers' speculative entries made in one time
--                                   bucket; expires by itself two buckets after that one began
-- Every incarnation gets a slot of its own, and a slot is handed out again only after a sweep
-- pass cleared its bits; so a block's bitmap is as wide as the live replicas plus the slots
-- waiting for a sweep, whatever the history, and a lookup needs no liveness check: the caller
-- maps slots to the live replicas it read.

local MAX_SLOTS = 8192 -- bitmaps stay <= 1 KiB, and every unpack() below stays bounded
-- A sweep pass frees the slots that died this long before it began: writes an ended
-- incarnation still had in flight, and its speculative bits (buckets <= 20 s), are gone by then.
local QUARANTINE_MS = 60000
-- A freed slot waits this long before it is handed out again: a sweep step planned before it
-- was freed (and so still clearing it) is over by then.
local GRACE_MS = 30000

-- the 8-byte hash of the i-th (1-based) block of packed
local function hash_at(packed, i)
  return string.sub(packed, i * 8 - 7, i * 8)
end

local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Records and reservations are read by every router's decisions: what would break them is
-- refused here (the router also reads any record defensively).
local TEXT_FIELDS = {address = true, model_id = true, http_address = true, hardware = true, engine = true}

local function finite(v)
  local n = tonumber(v)
  return n ~= nil and n == n and n ~= math.huge and n ~= -math.huge
end

-- The number a shared key holds, or nil: every role can write its keys raw (a function's
-- commands are checked against its caller's ACL user), so what they hold is never trusted.
local function number(v)
  if finite(v) then return tonumber(v) end
  return nil
end

-- A whole number below 1e14 (printed without an exponent: it becomes part of key names).
local function counter(v)
  local n = number(v)
  if n and n >= 0 and n < 1e14 and n == math.floor(n) then return n end
  return nil
end

-- nil, or an error reply naming the first field of ARGV (from `first`, in pairs) that is not
-- a finite number (text fields excepted) or, for the address, not "host:port"
local function malformed(args, first)
  for j = first, #args, 2 do
    local name, value = args[j], args[j + 1]
    if name == 'address' or name == 'http_address' then
      if not string.match(value, '^[%w%.%-%[%]:/]+:%d+$') then
        return redis.error_reply('ERR kvmesh: ' .. name .. ' is not host:port')
      end
    elseif (name == 'hardware' or name == 'engine') and #value > 64 then
      return redis.error_reply('ERR kvmesh: ' .. name .. ' is longer than 64 bytes')
    elseif not TEXT_FIELDS[name] and not finite(value) then
      return redis.error_reply('ERR kvmesh: field ' .. name .. ' is not a finite number')
    end
  end
  return nil
end

-- ---------------------------------------------------------------- block keys: KEYS[1] = prefix

-- KEYS[1]: the chain's first block key; ARGV[1]: the whole chain packed (8 bytes a block).
-- Returns {depth, published, speculative, tiered, ...}: bitmaps of the slots holding exactly
-- `depth` leading blocks of the chain on their device, by routers' speculation, and on their
-- device or host (a host tier continues a device prefix).
-- A replica that holds a block holds its parents (a block manager evicts a chain tail first,
-- in each tier and in both together, and speculation covers whole chains), so the holders of
-- block k only shrink as k grows and the depths are found by bisection: O(log n) reads of four
-- small strings, two reads when every holder holds the whole chain, whatever its length.
-- The depths by bisection, when the last block's holders differ from the first's:
-- got_first/got_last are both blocks' four bitmaps, w the first block's widest.
local function bisect(prefix, packed, n, w, got_first, got_last)
  -- bitmap s as w byte values (zero-padded; bits past the first block's width hold nothing
  -- that matters: every holder of the chain holds its first block)
  local function bytes(s)
    local b = {string.byte(s or '', 1, w)}
    for i = #b + 1, w do b[i] = 0 end
    return b
  end
  -- a block's holders as 3w byte values: published bytes, speculative ones, device or host
  local function set_of(got)
    local out, s0, s1, host = bytes(got[1]), bytes(got[2]), bytes(got[3]), bytes(got[4])
    for i = 1, w do
      out[w + i] = bit.bor(s0[i], s1[i])
      out[2 * w + i] = bit.bor(out[i], host[i])
    end
    return out
  end
  local function read(k)
    local h = hash_at(packed, k)
    return set_of(redis.call('MGET', prefix .. h, prefix .. '~0' .. h, prefix .. '~1' .. h, prefix .. 'h' .. h))
  end
  local function inter(a, b)
    local out = {}
    for i = 1, 3 * w do out[i] = bit.band(a[i], b[i]) end
    return out
  end
  local function same(a, b)
    for i = 1, 3 * w do if a[i] ~= b[i] then return false end end
    return true
  end
  local function empty(a)
    for i = 1, 3 * w do if a[i] ~= 0 then return false end end
    return true
  end

  local out = {}
  local function emit(d, set)
    if not empty(set) then
      out[#out + 1] = d
      out[#out + 1] = string.char(unpack(set, 1, w))
      out[#out + 1] = string.char(unpack(set, w + 1, 2 * w))
      out[#out + 1] = string.char(unpack(set, 2 * w + 1, 3 * w))
    end
  end
  -- s_lo holds block lo, s_hi block hi (s_hi within s_lo): emits those of s_lo not in s_hi
  local function solve(lo, hi, s_lo, s_hi)
    if same(s_lo, s_hi) then return end
    if hi == lo + 1 then
      local gone = {}
      for i = 1, 3 * w do gone[i] = bit.band(s_lo[i], bit.bnot(s_hi[i])) end
      emit(lo, gone)
      return
    end
    local mid = math.floor((lo + hi) / 2)
    local s_mid = inter(s_lo, read(mid))
    solve(lo, mid, s_lo, s_mid)
    solve(mid, hi, s_mid, s_hi)
  end

  local s_first = set_of(got_first)
  local s_last = inter(s_first, set_of(got_last))
  if same(s_first, s_last) then -- every holder holds the whole chain
    return {n, got_first[1] or '', string.char(unpack(s_first, w + 1, 2 * w)),
      string.char(unpack(s_first, 2 * w + 1, 3 * w))}
  end
  emit(n, s_last)
  solve(1, n, s_first, s_last)
  return out
end

local function lookup(keys, args)
  local first, packed = keys[1], args[1]
  local n = #packed / 8
  if n == 0 then return {} end
  local prefix = string.sub(first, 1, #first - 8)
  -- the first and the last block in one call (each redis.call costs microseconds on its own)
  local h1, hn = hash_at(packed, 1), hash_at(packed, n)
  local got = redis.call('MGET', prefix .. h1, prefix .. '~0' .. h1, prefix .. '~1' .. h1, prefix .. 'h' .. h1,
    prefix .. hn, prefix .. '~0' .. hn, prefix .. '~1' .. hn, prefix .. 'h' .. hn)
  -- (a bitmap wider than MAX_SLOTS bits was not written by kvmesh: its excess is ignored)
  local w = math.min(math.max(#(got[1] or ''), #(got[2] or ''), #(got[3] or ''), #(got[4] or '')), MAX_SLOTS / 8)
  if w == 0 then return {} end
  if got[5] == got[1] and got[6] == got[2] and got[7] == got[3] and not (got[2] and got[3])
    and not got[4] and not got[8] then
    -- the common case, no byte work: the last block has exactly the first one's holders, and
    -- no host tier holds either
    return {n, got[1] or '', got[2] or got[3] or '', got[1] or ''}
  end
  return bisect(prefix, packed, n, w, {got[1], got[2], got[3], got[4]}, {got[5], got[6], got[7], got[8]})
end

-- KEYS[1]: the first block-key prefix below; ARGV: slot, then (prefix, op, packed hashes)
-- triples, op "+" or "-" (device tier), "h+" or "h-" (host tier), applied in order; every
-- prefix on this server (one call carries a whole batch on a single server, one root's blocks
-- on a cluster). Returns the blocks applied.
local function publish(keys, args)
  local slot, applied = tonumber(args[1]), 0
  for j = 2, #args, 3 do
    local op, packed = args[j + 1], args[j + 2]
    local add, prefix = string.sub(op, -1) == '+', args[j] .. string.sub(op, 1, -2)
    for i = 1, #packed / 8 do
      local key = prefix .. hash_at(packed, i)
      if add then
        redis.call('SETBIT', key, slot, 1)
      elseif redis.call('GETBIT', key, slot) == 1 then -- (SETBIT 0 would grow or create it)
        redis.call('SETBIT', key, slot, 0)
        if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
      end
    end
    applied = applied + #packed / 8
  end
  return applied
end

-- KEYS[1]: the block-key prefix of one root; ARGV: the bucket length (ms), then (slot, packed
-- chain) pairs: "a router just sent that replica a prompt with these blocks", so every router
-- routes the rest of a burst there before the replica's own events arrive. An entry lives one
-- to two buckets, then expires by itself (a key per block and bucket parity, with a TTL).
local function speculate(keys, args)
  local prefix, length = keys[1], tonumber(args[1])
  local bucket = math.floor(server_ms() / length)
  -- expires 1 ms before the bucket that reuses its parity begins, so that bucket starts empty
  local parity, ends = tostring(bucket % 2), (bucket + 2) * length - 1
  for j = 2, #args, 2 do
    local slot, packed = tonumber(args[j]), args[j + 1]
    for i = 1, #packed / 8 do
      local key = prefix .. '~' .. parity .. hash_at(packed, i)
      redis.call('SETBIT', key, slot, 1)
      redis.call('PEXPIREAT', key, ends)
    end
  end
  return 1
end

-- ARGV: the block-key pattern of one deployment, the length of its published device block
-- keys (host keys are one byte longer), cursor, count, then dead slots. One SCAN step over
-- this server's block keys, clearing the dead slots' bits (keys left empty go). Returns {next
-- cursor, bits cleared}.
local function sweep(keys, args)
  local pattern, key_length, cursor, count = args[1], tonumber(args[2]), args[3], args[4]
  local res = redis.call('SCAN', cursor, 'MATCH', pattern, 'COUNT', count)
  local cleared = 0
  for _, key in ipairs(res[2]) do
    if #key == key_length or #key == key_length + 1 then
      local changed = false
      for j = 5, #args do
        if redis.call('GETBIT', key, args[j]) == 1 then -- (SETBIT 0 would widen the key)
          redis.call('SETBIT', key, args[j], 0)
          cleared = cleared + 1; changed = true
        end
      end
      if changed and redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
    end
  end
  return {res[1], cleared}
end

-- ---------------------------------------------------------------- control keys: KEYS[1] = ns

-- The next incarnation number, replicas' and routers' alike. The counter may hold anything
-- (garbage counts as 0) or have been set back, so a number still in use by a live router or
-- a router's unreaped share is never handed out again (a replica's liveness is its own key:
-- two replicas on one number never touch each other's), and a replica's new incarnation is
-- above its previous one (``above``).
local function new_incarnation(ns, above)
  local ok, stored = pcall(redis.call, 'GET', ns .. 'next')
  local n = math.max((ok and counter(stored)) or 0, above or 0)
  repeat
    n = n + 1
  until redis.call('EXISTS', ns .. 'ri' .. n, ns .. 'w' .. n) == 0
    and redis.call('SISMEMBER', ns .. 'routers', n) == 0
  redis.call('SET', ns .. 'next', n)
  return n
end

-- ARGV: ttl_ms. A new router incarnation; returns its number.
local function router_register(keys, args)
  local ns, ttl = keys[1], args[1]
  local rinc = new_incarnation(ns)
  redis.call('SET', ns .. 'ri' .. rinc, '1', 'PX', ttl)
  redis.call('SADD', ns .. 'routers', rinc)
  return rinc
end

-- HINCRBYFLOAT, dropping the field once it is back to zero (no float dust left behind).
local function add_work(key, field, delta)
  local left = tonumber(redis.call('HINCRBYFLOAT', key, field, delta))
  if math.abs(left) < 1e-6 then redis.call('HDEL', key, field) end
end

-- The fleet's work on a replica is one field of ns.."load", "<requests> <prefill> <decode>"
-- (a decision reads a third of the fields one per number would take); field "<replica>|n|p|d".
local KINDS = {n = 1, p = 2, d = 3}
local function add_load(key, field, delta)
  local rid, kind = string.match(field, '^(.*)|([npd])$')
  if not rid then return end
  local w = {0, 0, 0}
  local cur = redis.call('HGET', key, rid)
  local a, b, c = string.match(cur or '', '^(%S+) (%S+) (%S+)$')
  if number(a) and number(b) and number(c) then w = {number(a), number(b), number(c)} end
  w[KINDS[kind]] = w[KINDS[kind]] + tonumber(delta)
  for i = 1, 3 do if math.abs(w[i]) < 1e-6 then w[i] = 0 end end
  if w[1] == 0 and w[2] == 0 and w[3] == 0 then
    redis.call('HDEL', key, rid)
  else
    redis.call('HSET', key, rid, string.format('%.17g %.17g %.17g', w[1], w[2], w[3]))
  end
end

-- Take back what dead router incarnations reserved (their heartbeat key expired).
local function reap(ns)
  local reaped = 0
  for _, rinc in ipairs(redis.call('SMEMBERS', ns .. 'routers')) do
    if redis.call('EXISTS', ns .. 'ri' .. rinc) == 0 then
      local share = redis.call('HGETALL', ns .. 'w' .. rinc)
      for j = 1, #share, 2 do
        local held = number(share[j + 1])
        if held then add_load(ns .. 'load', share[j], -held) end
      end
      redis.call('DEL', ns .. 'w' .. rinc)
      redis.call('SREM', ns .. 'routers', rinc)
      reaped = reaped + 1
    end
  end
  return reaped
end

-- ARGV: rinc, ttl_ms. Extends the router's life and reaps the dead ones'; returns how many
-- routers are registered then, itself included (0: it expired, its reservations are gone:
-- register anew).
local function router_heartbeat(keys, args)
  local ns = keys[1]
  local alive = redis.call('PEXPIRE', ns .. 'ri' .. args[1], args[2])
  reap(ns)
  if alive == 0 then return 0 end
  return redis.call('SCARD', ns .. 'routers')
end

-- ARGV: rinc. A graceful exit: its reservations go now.
local function router_deregister(keys, args)
  redis.call('DEL', keys[1] .. 'ri' .. args[1])
  return reap(keys[1])
end

-- ARGV: rinc, then (field, delta) pairs, field "<replica>|n|p|d". Applies them to the
-- fleet's totals and the router's share; 0 (nothing applied) if the router is not live.
local function reserve(keys, args)
  local ns, rinc = keys[1], args[1]
  for j = 3, #args, 2 do
    if not finite(args[j]) then return redis.error_reply('ERR kvmesh: a reservation is not a finite number') end
  end
  if redis.call('EXISTS', ns .. 'ri' .. rinc) == 0 then return 0 end
  local mine = ns .. 'w' .. rinc
  for j = 2, #args, 2 do
    add_load(ns .. 'load', args[j], args[j + 1])
    add_work(mine, args[j], args[j + 1])
  end
  return 1
end

-- A slot no live or recent incarnation has: the lowest free one.
local function fresh_slot(ns)
  local used, now = {}, server_ms()
  for _, s in ipairs(redis.call('HVALS', ns .. 'slots')) do
    if counter(s) then used[counter(s)] = true end
  end
  local dead = redis.call('HGETALL', ns .. 'dead') -- slot -> died at, or -(freed at)
  for j = 1, #dead, 2 do
    local at = number(dead[j + 1])
    if not counter(dead[j]) then
      redis.call('HDEL', ns .. 'dead', dead[j]) -- not a slot at all
    elseif at and at < 0 and now + at > GRACE_MS then
      redis.call('HDEL', ns .. 'dead', dead[j])
    else
      used[counter(dead[j])] = true
    end
  end
  local slot = 0
  while used[slot] do slot = slot + 1 end
  if slot >= MAX_SLOTS then return redis.error_reply('no free replica slot (' .. MAX_SLOTS .. ' in use)') end
  return slot
end

-- The replica's current incarnation (if any) ends: its slot waits for a sweep pass.
local function end_slot(ns, rid)
  local slot = redis.call('HGET', ns .. 'slots', rid)
  if slot then
    redis.call('HSET', ns .. 'dead', slot, server_ms())
    redis.call('HDEL', ns .. 'slots', rid)
  end
end

-- ARGV: replica_id, ttl_ms, then record field/value pairs (a few, set by kvmesh). Retires the
-- replica's previous incarnation (O(1)), starts a new live one on a fresh slot; returns
-- {incarnation, slot}.
local function register(keys, args)
  local ns, rid, ttl = keys[1], args[1], args[2]
  local refused = malformed(args, 3)
  if refused then return refused end
  -- what can fail comes first, so a refused register changes nothing (a function's writes
  -- before an error stay: the replica's old slot must not end for a register that failed)
  local slot = fresh_slot(ns)
  if type(slot) == 'table' then return slot end
  local rkey = ns .. 'r:' .. rid
  local inc = new_incarnation(ns, counter(redis.call('HGET', rkey, 'incarnation')))
  end_slot(ns, rid)
  redis.call('HSET', ns .. 'slots', rid, slot)
  redis.call('DEL', rkey)
  redis.call('HSET', rkey, 'replica_id', rid, 'incarnation', inc, 'slot', slot)
  for j = 3, #args, 2 do redis.call('HSET', rkey, args[j], args[j + 1]) end
  redis.call('SET', ns .. 'l:' .. rid, inc, 'PX', ttl) -- the previous incarnation is no longer live
  redis.call('SADD', ns .. 'replicas', rid)
  return {inc, slot}
end

-- ARGV: replica_id, incarnation, ttl_ms, then load field/value pairs.
-- Returns 0 if the incarnation is no longer live (expired or retired).
local function heartbeat(keys, args)
  local ns, rid, inc, ttl = keys[1], args[1], args[2], args[3]
  local refused = malformed(args, 4)
  if refused then return refused end
  local lkey = ns .. 'l:' .. rid
  if redis.call('GET', lkey) ~= inc then return 0 end
  redis.call('PEXPIRE', lkey, ttl)
  -- keys read only now and then stay in use, so a memory-full server never evicts them
  redis.call('TOUCH', ns .. 'settings', ns .. 'slots', ns .. 'dead', ns .. 'next', ns .. 'replicas')
  local rkey = ns .. 'r:' .. rid
  for j = 4, #args, 2 do redis.call('HSET', rkey, args[j], args[j + 1]) end
  return 1
end

-- The replica's record goes (if it is still there), and its slot waits for a sweep pass.
local function forget(ns, rid)
  end_slot(ns, rid)
  if redis.call('EXISTS', ns .. 'r:' .. rid) == 1 then redis.call('DEL', ns .. 'r:' .. rid) end
  redis.call('SREM', ns .. 'replicas', rid)
end

-- ARGV: replica_id, incarnation. Graceful exit: gone from lookups at once.
local function deregister(keys, args)
  local ns, rid, inc = keys[1], args[1], args[2]
  if redis.call('GET', ns .. 'l:' .. rid) ~= inc then return 0 end
  redis.call('DEL', ns .. 'l:' .. rid)
  forget(ns, rid)
  return 1
end

-- ARGV: replica_id. Ends its current incarnation now (its process was seen dead).
local function retire(keys, args)
  return redis.call('DEL', keys[1] .. 'l:' .. args[1])
end

-- Returns {slots no live incarnation owns (dead, or of a replica whose heartbeat lapsed), then
-- record as flat field/value list, remaining TTL ms for every live replica}. Reads only: a
-- router's user may not write the replicas' keys (ids whose record is gone: ``swept``).
local function live_replicas(keys, args)
  local ns = keys[1]
  local out, dead = {{}}, {}
  for _, s in ipairs(redis.call('HKEYS', ns .. 'dead')) do dead[#dead + 1] = s end
  for _, rid in ipairs(redis.call('SMEMBERS', ns .. 'replicas')) do
    local rec = redis.call('HGETALL', ns .. 'r:' .. rid)
    local inc, slot
    for j = 1, #rec, 2 do
      if rec[j] == 'incarnation' then inc = rec[j + 1] elseif rec[j] == 'slot' then slot = rec[j + 1] end
    end
    local lkey = ns .. 'l:' .. rid
    local ttl = redis.call('PTTL', lkey)
    if inc and ttl > 0 and redis.call('GET', lkey) == inc then
      out[#out + 1] = rec
      out[#out + 1] = ttl
    elseif slot then
      dead[#dead + 1] = slot
    end
  end
  out[1] = dead
  return out
end

-- Returns {server ms, dead slots}: what a sweep step clears, and when its pass began.
local function sweep_plan(keys, args)
  return {server_ms(), redis.call('HKEYS', keys[1] .. 'dead')}
end

-- ARGV: when (server ms) a sweep pass that visited every block key began. Slots that died
-- QUARANTINE_MS before then have no bits left: they are freed (handed out after GRACE_MS).
-- Ids whose record is gone (evicted, deleted) are forgotten, their slot ended.
local function swept(keys, args)
  local ns, began = keys[1], tonumber(args[1])
  for _, rid in ipairs(redis.call('SMEMBERS', ns .. 'replicas')) do
    if redis.call('EXISTS', ns .. 'r:' .. rid) == 0 then forget(ns, rid) end
  end
  local freed, dead = 0, redis.call('HGETALL', ns .. 'dead')
  local now = server_ms()
  for j = 1, #dead, 2 do
    local died = number(dead[j + 1])
    if not died then
      redis.call('HSET', ns .. 'dead', dead[j], now) -- not a time: quarantined again from now
    elseif died >= 0 and died < began - QUARANTINE_MS then
      redis.call('HSET', ns .. 'dead', dead[j], -now); freed = freed + 1
    end
  end
  return freed
end

-- 1 if the settings exist (0 after a restart that lost the data).
local function has_settings(keys, args)
  return redis.call('EXISTS', keys[1] .. 'settings')
end

-- ARGV: field/value pairs. Stores the settings if none exist; returns the stored ones (flat)
-- so the caller can compare.
local function settings(keys, args)
  local key = keys[1] .. 'settings'
  if redis.call('EXISTS', key) == 0 then
    for j = 1, #args, 2 do redis.call('HSET', key, args[j], args[j + 1]) end
  end
  return redis.call('HGETALL', key)
end

local function expose(name, callback, flags)
  redis.register_function{function_name = 'kvmesh_@VERSION@_' .. name, callback = callback, flags = flags or {}}
end

expose('lookup', lookup, {'no-writes'})
expose('publish', publish, {'allow-cross-slot-keys'})  -- a batch's roots, one server
expose('speculate', speculate)
expose('sweep', sweep, {'allow-cross-slot-keys'})  -- every key SCAN finds on this server
expose('sweep_plan', sweep_plan, {'no-writes'})
expose('swept', swept)
expose('router_register', router_register)
expose('router_heartbeat', router_heartbeat)
expose('router_deregister', router_deregister)
expose('reserve', reserve)
expose('register', register)
expose('heartbeat', heartbeat)
expose('deregister', deregister)
expose('retire', retire)
expose('live_replicas', live_replicas, {'no-writes'})
expose('settings', settings)
expose('has_settings', has_settings, {'no-writes'})

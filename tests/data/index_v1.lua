#!lua name=kvmesh_index_v1
-- kvmesh's shared prefix index as Redis Functions (Redis >= 7, Valkey). Key layout, all
-- under one hash tag ns = "{k:<8 hex of the model id>}":
--   ns.."settings"     HASH  model_id, block_size, hash_seed (stored once, checked by all)
--   ns.."next"         STRING incarnation counter
--   ns.."replicas"     SET   replica ids ever registered (pruned when records vanish)
--   ns.."r:"..id       HASH  replica record: address, incarnation, started_at, load...
--   ns.."i"..inc       STRING replica id of a LIVE incarnation; its TTL is the heartbeat
--   ns.."b"..<8 bytes> SET   incarnations holding that block hash (an intset)
--   ns.."routers"      SET   router incarnations that may hold reservations
--   ns.."ri"..rinc     STRING a LIVE router incarnation; its TTL is the router's heartbeat
--   ns.."load"         HASH  "<replica>|n|p|d" -> in-flight requests, prefill and decode
--                            blocks the live routers reserved on that replica (fleet-wide)
--   ns.."w"..rinc      HASH  the same, one router incarnation's share (reaped when it dies)
--   ns.."sp"..rinc.."|"..bucket  HASH  replica id -> the speculative incarnation this router
--                            uses for it in that time bucket: its block entries sit in the
--                            block SETs like a replica's, its "i" key holds "~"..replica id and
--                            expires ttl after its last use, so speculation lives ttl to 2 ttl
-- A block entry counts only while its incarnation's "i" key exists, so retiring a dead
-- or restarted replica is one DEL (or a TTL expiry); kvmesh_sweep removes the leftovers.

-- cmd (SADD or SREM) of incarnation inc on every block key in packed (8-byte hashes); returns the count.
local function on_blocks(ns, cmd, packed, inc)
  local n = #packed / 8
  for i = 0, n - 1 do
    redis.call(cmd, ns .. 'b' .. string.sub(packed, i * 8 + 1, i * 8 + 8), inc)
  end
  return n
end

-- live[inc] = replica id, or false; one GET per incarnation per call.
local function liveness(ns)
  local cache = {}
  return function(inc)
    local known = cache[inc]
    if known == nil then
      known = redis.call('GET', ns .. 'i' .. inc) or false
      cache[inc] = known
    end
    return known
  end
end

-- KEYS: the chain's block keys (ns.."b"..<8 bytes>, built by the client: in Lua they cost more
-- than the intersection itself); ARGV: ns. Returns {replica_id, matched_blocks, ...}:
-- for each live replica, how many leading blocks of the chain it holds consecutively.
-- H(k), the replicas holding all of the first k blocks, only shrinks as k grows, so the
-- depths are found by bisection over k with SINTER on block ranges (done in C): when
-- every candidate holds the whole chain that is two calls, and a long walk is never
-- needed to find where the holders thin out.
local function matches(ns, bkeys)
  local n = #bkeys
  local depth, owner = {}, {}

  -- members of `within` that hold every block in (lo, hi] (1-based key positions)
  local function holding(within, lo, hi)
    local out, count = {}, 0
    for _, inc in ipairs(redis.call('SINTER', unpack(bkeys, lo + 1, hi))) do
      if within[inc] then out[inc] = true; count = count + 1 end
    end
    return out, count
  end

  -- s_lo = H(lo) (count c_lo), s_hi = H(hi); sets the depth of every member of s_lo \ s_hi.
  local function solve(lo, hi, s_lo, c_lo, s_hi, c_hi)
    if c_lo == c_hi then return end
    if hi == lo + 1 then
      for inc in pairs(s_lo) do if not s_hi[inc] then depth[inc] = lo end end
      return
    end
    local mid = math.floor((lo + hi) / 2)
    local s_mid, c_mid = holding(s_lo, lo, mid)
    solve(lo, mid, s_lo, c_lo, s_mid, c_mid)
    solve(mid, hi, s_mid, c_mid, s_hi, c_hi)
  end

  if n == 0 then return {} end
  -- live holders of the first block: one MGET for all their liveness keys
  local holders = redis.call('SMEMBERS', bkeys[1])
  if #holders == 0 then return {} end
  local ikeys = {}
  for j, inc in ipairs(holders) do ikeys[j] = ns .. 'i' .. inc end
  local first, c_first = {}, 0
  for j, rid in ipairs(redis.call('MGET', unpack(ikeys))) do
    if rid then first[holders[j]] = true; owner[holders[j]] = rid; c_first = c_first + 1 end
  end
  if c_first == 0 then return {} end
  local all, c_all = first, c_first
  if n > 1 then all, c_all = holding(first, 1, n) end
  for inc in pairs(all) do depth[inc] = n end
  solve(1, n, first, c_first, all, c_all)

  local out = {}
  for inc, d in pairs(depth) do
    out[#out + 1] = owner[inc]
    out[#out + 1] = d
  end
  return out
end

-- (A decision pipelines an HGETALL of ns.."load" behind this call: the fleet's work.)
local function lookup(keys, args)
  return matches(args[1], keys)
end

-- ARGV: ns, ttl_ms. A new router incarnation; returns its number.
local function router_register(keys, args)
  local ns, ttl = args[1], args[2]
  local rinc = redis.call('INCR', ns .. 'next')
  redis.call('SET', ns .. 'ri' .. rinc, '1', 'PX', ttl)
  redis.call('SADD', ns .. 'routers', rinc)
  return rinc
end

-- HINCRBYFLOAT, dropping the field once it is back to zero (no float dust left behind).
local function add_work(key, field, delta)
  local left = tonumber(redis.call('HINCRBYFLOAT', key, field, delta))
  if math.abs(left) < 1e-6 then redis.call('HDEL', key, field) end
end

-- Take back what dead router incarnations reserved (their heartbeat key expired).
local function reap(ns)
  local reaped = 0
  for _, rinc in ipairs(redis.call('SMEMBERS', ns .. 'routers')) do
    if redis.call('EXISTS', ns .. 'ri' .. rinc) == 0 then
      local share = redis.call('HGETALL', ns .. 'w' .. rinc)
      for j = 1, #share, 2 do add_work(ns .. 'load', share[j], -tonumber(share[j + 1])) end
      redis.call('DEL', ns .. 'w' .. rinc)
      redis.call('SREM', ns .. 'routers', rinc)
      reaped = reaped + 1
    end
  end
  return reaped
end

-- ARGV: ns, rinc, ttl_ms. Extends the router's life (0: it expired, its reservations are
-- gone: register anew) and reaps the dead ones'.
local function router_heartbeat(keys, args)
  local ns, rinc, ttl = args[1], args[2], args[3]
  local alive = redis.call('PEXPIRE', ns .. 'ri' .. rinc, ttl)
  reap(ns)
  return alive
end

-- ARGV: ns, rinc. A graceful exit: its reservations go now.
local function router_deregister(keys, args)
  redis.call('DEL', args[1] .. 'ri' .. args[2])
  return reap(args[1])
end

-- ARGV: ns, rinc, ttl_ms, bucket, then (replica id, packed block hashes) pairs: "this router
-- just sent that replica a prompt with these blocks" (the blocks past what the index showed),
-- so every router routes the rest of a burst there before the replica's own events arrive.
local function speculate(keys, args)
  local ns, rinc, ttl, bucket = args[1], args[2], args[3], args[4]
  if redis.call('EXISTS', ns .. 'ri' .. rinc) == 0 then return 0 end
  local map = ns .. 'sp' .. rinc .. '|' .. bucket
  for j = 5, #args, 2 do
    local rid, packed = args[j], args[j + 1]
    local inc = redis.call('HGET', map, rid)
    if not inc then
      inc = redis.call('INCR', ns .. 'next')
      redis.call('HSET', map, rid, inc)
      redis.call('PEXPIRE', map, 2 * ttl)
    end
    redis.call('SET', ns .. 'i' .. inc, '~' .. rid, 'PX', ttl)
    on_blocks(ns, 'SADD', packed, inc)
  end
  return 1
end

-- ARGV: ns, rinc, then (field, delta) pairs, field "<replica>|n|p|d". Applies them to the
-- fleet's totals and the router's share; 0 (nothing applied) if the router is not live.
local function reserve(keys, args)
  local ns, rinc = args[1], args[2]
  if redis.call('EXISTS', ns .. 'ri' .. rinc) == 0 then return 0 end
  local mine = ns .. 'w' .. rinc
  for j = 3, #args, 2 do
    add_work(ns .. 'load', args[j], args[j + 1])
    add_work(mine, args[j], args[j + 1])
  end
  return 1
end

-- ARGV: ns, replica_id, incarnation, then (op, packed hashes) pairs, op "+" or "-".
-- Applied in order. Returns 0 (and applies nothing) if the incarnation is not live:
-- the caller must resync under a new one.
local function publish(keys, args)
  local ns, rid, inc = args[1], args[2], args[3]
  if redis.call('GET', ns .. 'i' .. inc) ~= rid then return 0 end
  local applied = 0
  for j = 4, #args, 2 do
    applied = applied + on_blocks(ns, (args[j] == '+') and 'SADD' or 'SREM', args[j + 1], inc)
  end
  return applied
end

-- ARGV: ns, replica_id, ttl_ms, then record field/value pairs. Retires the replica's
-- previous incarnation (O(1)), starts a new live one, returns its number.
local function register(keys, args)
  local ns, rid, ttl = args[1], args[2], args[3]
  local rkey = ns .. 'r:' .. rid
  local old = redis.call('HGET', rkey, 'incarnation')
  if old then redis.call('DEL', ns .. 'i' .. old) end
  local inc = redis.call('INCR', ns .. 'next')
  redis.call('DEL', rkey)
  redis.call('HSET', rkey, 'replica_id', rid, 'incarnation', inc, unpack(args, 4))
  redis.call('SET', ns .. 'i' .. inc, rid, 'PX', ttl)
  redis.call('SADD', ns .. 'replicas', rid)
  return inc
end

-- ARGV: ns, replica_id, incarnation, ttl_ms, then load field/value pairs.
-- Returns 0 if the incarnation is no longer live (expired or retired).
local function heartbeat(keys, args)
  local ns, rid, inc, ttl = args[1], args[2], args[3], args[4]
  local ikey = ns .. 'i' .. inc
  if redis.call('GET', ikey) ~= rid then return 0 end
  redis.call('PEXPIRE', ikey, ttl)
  if #args > 4 then redis.call('HSET', ns .. 'r:' .. rid, unpack(args, 5)) end
  return 1
end

-- ARGV: ns, replica_id, incarnation. Graceful exit: gone from lookups at once.
local function deregister(keys, args)
  local ns, rid, inc = args[1], args[2], args[3]
  if redis.call('GET', ns .. 'i' .. inc) ~= rid then return 0 end
  redis.call('DEL', ns .. 'i' .. inc, ns .. 'r:' .. rid)
  redis.call('SREM', ns .. 'replicas', rid)
  return 1
end

-- ARGV: ns, replica_id. Ends its current incarnation now (its process was seen dead).
local function retire(keys, args)
  local ns, rid = args[1], args[2]
  local inc = redis.call('HGET', ns .. 'r:' .. rid, 'incarnation')
  if not inc then return 0 end
  return redis.call('DEL', ns .. 'i' .. inc)
end

-- ARGV: ns. Returns {record as flat field/value list, remaining TTL ms} for every live
-- replica; drops ids whose record is gone.
local function live_replicas(keys, args)
  local ns = args[1]
  local out = {}
  for _, rid in ipairs(redis.call('SMEMBERS', ns .. 'replicas')) do
    local rec = redis.call('HGETALL', ns .. 'r:' .. rid)
    if #rec == 0 then
      redis.call('SREM', ns .. 'replicas', rid)
    else
      local inc
      for j = 1, #rec, 2 do if rec[j] == 'incarnation' then inc = rec[j + 1] end end
      local ttl = redis.call('PTTL', ns .. 'i' .. inc)
      if ttl > 0 and redis.call('GET', ns .. 'i' .. inc) == rid then
        out[#out + 1] = rec
        out[#out + 1] = ttl
      end
    end
  end
  return out
end

-- ARGV: ns, cursor, count. One SCAN step over block keys, removing entries of
-- incarnations that are not live. Returns {next cursor, entries removed}.
local function sweep(keys, args)
  local ns, cursor, count = args[1], args[2], args[3]
  local live = liveness(ns)
  local res = redis.call('SCAN', cursor, 'MATCH', ns .. 'b*', 'COUNT', count)
  local removed = 0
  for _, key in ipairs(res[2]) do
    for _, inc in ipairs(redis.call('SMEMBERS', key)) do
      if not live(inc) then removed = removed + redis.call('SREM', key, inc) end
    end
  end
  return {res[1], removed}
end

-- ARGV: ns. 1 if the settings exist (0 after a restart that lost the data).
local function has_settings(keys, args)
  return redis.call('EXISTS', args[1] .. 'settings')
end

-- ARGV: ns, then field/value pairs. Stores the settings if none exist; returns the
-- stored ones (flat) so the caller can compare.
local function settings(keys, args)
  local key = args[1] .. 'settings'
  if redis.call('EXISTS', key) == 0 then redis.call('HSET', key, unpack(args, 2)) end
  return redis.call('HGETALL', key)
end

redis.register_function{function_name = 'kvmesh_lookup', callback = lookup, flags = {'no-writes'}}
redis.register_function('kvmesh_speculate', speculate)
redis.register_function('kvmesh_router_register', router_register)
redis.register_function('kvmesh_router_heartbeat', router_heartbeat)
redis.register_function('kvmesh_router_deregister', router_deregister)
redis.register_function('kvmesh_reserve', reserve)
redis.register_function('kvmesh_publish', publish)
redis.register_function('kvmesh_register', register)
redis.register_function('kvmesh_heartbeat', heartbeat)
redis.register_function('kvmesh_deregister', deregister)
redis.register_function('kvmesh_retire', retire)
redis.register_function('kvmesh_live_replicas', live_replicas)
redis.register_function('kvmesh_sweep', sweep)
redis.register_function('kvmesh_settings', settings)
redis.register_function{function_name = 'kvmesh_has_settings', callback = has_settings, flags = {'no-writes'}}

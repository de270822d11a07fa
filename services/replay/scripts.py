"""The Lua scripts that make every multi-key change of the replay buffer atomic.

Key layout, all under one prefix `flywheel:{<run>}:replay:` (the braces are a Redis hash
tag, so every key of a run lands in one slot and one script may touch them all):

    g:<id>        string  the TrajectoryGroup bytes exactly as received
    fifo          zset    unchosen ids -> ingest sequence number
    ver           zset    unchosen ids -> version_start
    fin           zset    unchosen ids -> finished_at (unix seconds), for the oldest age
    seq           int     ingest sequence counter
    d:<id>        string  tombstone of a chosen-and-committed or evicted id (expires after the TTL)
    choice:<s>    list    the ids chosen for step s, in selection order
    steps         zset    steps with a recorded choice -> step
    committed     int     highest committed checkpoint step (absent: -1)
    n:stale, n:dup, n:dead  counters
    dl:<marker>   string  one dead-lettered stream message (so a redelivery is counted once)

A group id is stored once: `put` refuses it while `g:<id>` or its tombstone exists.
"""

from __future__ import annotations

# Shared helpers. ZREM/MGET take at most ~8000 Lua stack slots, so big lists go in chunks.
_HELPERS = """
local p = ARGV[1]
local function each_chunk(list, fn)
  for i = 1, #list, 1000 do
    fn(unpack(list, i, math.min(i + 999, #list)))
  end
end
local function unindex(ids)
  each_chunk(ids, function(...)
    redis.call('ZREM', p .. 'fifo', ...)
    redis.call('ZREM', p .. 'ver', ...)
    redis.call('ZREM', p .. 'fin', ...)
  end)
end
local function payloads(ids)
  local out = {}
  for i, id in ipairs(ids) do out[i] = redis.call('GET', p .. 'g:' .. id) end
  return out
end
local function bury(id, ttl)
  redis.call('SET', p .. 'd:' .. id, 1, 'EX', ttl)
end
"""

# ARGV: prefix, group_id, version_start, finished_at_s, payload. Returns 1 stored, 0 duplicate.
PUT = _HELPERS + """
local id = ARGV[2]
if redis.call('EXISTS', p .. 'g:' .. id, p .. 'd:' .. id) > 0 then
  redis.call('INCR', p .. 'n:dup')
  return 0
end
redis.call('SET', p .. 'g:' .. id, ARGV[5])
local seq = redis.call('INCR', p .. 'seq')
redis.call('ZADD', p .. 'fifo', seq, id)
redis.call('ZADD', p .. 'ver', ARGV[3], id)
redis.call('ZADD', p .. 'fin', ARGV[4], id)
return 1
"""

# ARGV: prefix, step, n, max_staleness, policy ('fifo' | 'freshest'), tombstone ttl.
# Returns {status, missing_or_committed, stale_ids, chosen_ids, payloads, replayed, chosen_versions}:
# status 1 ready, 0 not ready (missing groups), -1 step already committed.
SAMPLE = _HELPERS + """
local step, n, k, policy, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6]
local choice = p .. 'choice:' .. ARGV[2]
local recorded = redis.call('LRANGE', choice, 0, -1)
if #recorded > 0 then
  return {1, 0, {}, recorded, payloads(recorded), 1, {}}
end
local committed = tonumber(redis.call('GET', p .. 'committed') or '-1')
if step <= committed then
  return {-1, committed, {}, {}, {}, 0, {}}
end
-- Stale for this step means stale for every later one: steps only grow.
local stale = redis.call('ZRANGEBYSCORE', p .. 'ver', '-inf', '(' .. string.format('%d', step - k))
for _, id in ipairs(stale) do
  redis.call('DEL', p .. 'g:' .. id)
  bury(id, ttl)
end
unindex(stale)
if #stale > 0 then redis.call('INCRBY', p .. 'n:stale', #stale) end
local eligible = redis.call('ZCOUNT', p .. 'ver', '-inf', string.format('%d', step))
if eligible < n then
  return {0, n - eligible, stale, {}, {}, 0, {}}
end
local chosen = {}
if policy == 'freshest' then
  -- Highest version_start first; ingest order breaks ties, so the choice is deterministic.
  local flat = redis.call('ZRANGEBYSCORE', p .. 'ver', '-inf', string.format('%d', step), 'WITHSCORES')
  local cands = {}
  for i = 1, #flat, 2 do
    local id = flat[i]
    cands[#cands + 1] = {id, tonumber(flat[i + 1]), tonumber(redis.call('ZSCORE', p .. 'fifo', id))}
  end
  table.sort(cands, function(a, b)
    if a[2] ~= b[2] then return a[2] > b[2] end
    return a[3] < b[3]
  end)
  for i = 1, n do chosen[i] = cands[i][1] end
else
  -- Ingest order; groups newer than the step (version_start > step) wait their turn.
  for _, id in ipairs(redis.call('ZRANGE', p .. 'fifo', 0, -1)) do
    if tonumber(redis.call('ZSCORE', p .. 'ver', id)) <= step then
      chosen[#chosen + 1] = id
      if #chosen == n then break end
    end
  end
end
local versions = {}
for i, id in ipairs(chosen) do versions[i] = redis.call('ZSCORE', p .. 'ver', id) end
each_chunk(chosen, function(...) redis.call('RPUSH', choice, ...) end)
redis.call('ZADD', p .. 'steps', step, ARGV[2])
unindex(chosen)
return {1, 0, stale, chosen, payloads(chosen), 0, versions}
"""

# ARGV: prefix, step, tombstone ttl. Deletes the choices of steps <= step and their groups.
COMMIT = _HELPERS + """
local step, ttl = tonumber(ARGV[2]), ARGV[3]
local deleted = 0
for _, s in ipairs(redis.call('ZRANGEBYSCORE', p .. 'steps', '-inf', ARGV[2])) do
  for _, id in ipairs(redis.call('LRANGE', p .. 'choice:' .. s, 0, -1)) do
    deleted = deleted + redis.call('DEL', p .. 'g:' .. id)
    bury(id, ttl)
  end
  redis.call('DEL', p .. 'choice:' .. s)
end
redis.call('ZREMRANGEBYSCORE', p .. 'steps', '-inf', ARGV[2])
local committed = tonumber(redis.call('GET', p .. 'committed') or '-1')
if step > committed then redis.call('SET', p .. 'committed', ARGV[2]) end
return deleted
"""

# ARGV: prefix, marker, ttl. Counts one dead-lettered message once; returns 1 if new.
DEAD_LETTER = _HELPERS + """
if redis.call('SET', p .. 'dl:' .. ARGV[2], 1, 'NX', 'EX', ARGV[3]) then
  redis.call('INCR', p .. 'n:dead')
  return 1
end
return 0
"""

"""The Lua scripts that make every multi-key change of the replay buffer atomic.

Key layout, all under one prefix `flywheel:{<run>}:replay:` (the braces are a Redis hash
tag, so every key of a run lands in one slot and one script may touch them all):

    g:<id>        string  the TrajectoryGroup bytes exactly as received, while unchosen
    in:<id>       string  the same bytes on their way in: written by a plain SET, moved to g:<id> by PUT
    c:<s>:<i>     string  the same bytes once chosen: the i-th group of step s's batch (moved from g:<id>)
    held          set     chosen ids whose step is not committed yet
    fifo          zset    unchosen ids -> ingest sequence number
    ver           zset    unchosen ids -> version_start
    fin           zset    unchosen ids -> finished_at (unix seconds), for the oldest age
    seq           int     ingest sequence counter
    d:<id>        string  tombstone of a chosen-and-committed or evicted id (expires after the TTL)
    choice:<s>    list    the ids chosen for step s, in selection order
    steps         zset    steps with a recorded choice -> step
    committed     int     highest committed checkpoint step (absent: -1)
    trainer:step  int     highest step the trainer reported finished (StepReport.step; absent: -1)
    trainer:ckpt  int     highest step the trainer reported checkpointed (StepReport.checkpoint_step; absent: -1)
    stale:outbox  list    ids evicted as stale that the controller has not been told of yet (trimmed once published)
    n:stale, n:dup, n:dead  counters
    dl:<marker>   string  one dead-lettered stream message (so a redelivery is counted once)

A group id is stored once: `put` refuses it while `g:<id>` exists, it is held, or it has a tombstone.

Payloads never pass through Lua: a 127 kB argument or reply costs a script ~0.2 ms of Redis's one
thread (copied into and out of Lua strings) where a plain SET or MGET costs microseconds. Instead they
are moved by key with RENAME (O(1), no copy): a put is `SET in:<id>` followed, in the same pipeline, by
PUT, which moves it to g:<id> (or deletes it for a duplicate); SAMPLE moves the chosen groups to
c:<step>:0..n-1, names the caller knows before the script runs, so `MGET` of them follows the script in
the same round trip.

The trainer's frontier is the highest step it is known to have reached: the highest recorded
choice, committed or reported step. With the `in_order` flag, Sample refuses steps past the
frontier + 1 and Commit refuses anything but a forward move to a reported checkpoint that is
not past the frontier, before touching anything (so no caller can skip or rewind the run).
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
local function bury(id, ttl)
  redis.call('SET', p .. 'd:' .. id, 1, 'EX', ttl)
end
local function num(key)
  return tonumber(redis.call('GET', p .. key) or '-1')
end
local function frontier()
  local top = redis.call('ZRANGE', p .. 'steps', -1, -1, 'WITHSCORES')
  local f = math.max(num('committed'), num('trainer:step'))
  if #top > 0 then f = math.max(f, tonumber(top[2])) end
  return f
end
"""

# ARGV: prefix, then (group_id, version_start, finished_at_s) per group; each payload waits in in:<id> (its SET came
# first, in the same pipeline). Returns 1 (stored) or 0 (duplicate) per group. The SET's expiry (an in:<id> whose
# PUT never ran, e.g. replay killed between the two, goes away by itself; the message comes back anyway) is dropped
# once the payload is stored.
PUT = _HELPERS + """
local out = {}
for i = 2, #ARGV, 3 do
  local id = ARGV[i]
  local staged, stored = p .. 'in:' .. id, p .. 'g:' .. id
  if redis.call('EXISTS', stored, p .. 'd:' .. id) > 0 or redis.call('SISMEMBER', p .. 'held', id) == 1 then
    redis.call('DEL', staged)
    redis.call('INCR', p .. 'n:dup')
    out[#out + 1] = 0
  else
    redis.call('RENAME', staged, stored)
    redis.call('PERSIST', stored)
    local seq = redis.call('INCR', p .. 'seq')
    redis.call('ZADD', p .. 'fifo', seq, id)
    redis.call('ZADD', p .. 'ver', ARGV[i + 1], id)
    redis.call('ZADD', p .. 'fin', ARGV[i + 2], id)
    out[#out + 1] = 1
  end
end
return out
"""

# ARGV: prefix, step, n, max_staleness, policy ('fifo' | 'freshest'), tombstone ttl, in_order ('1' | '0').
# Returns {status, missing_or_bound, stale_ids, chosen_ids, replayed, chosen_versions}; the payloads of the batch
# are then at c:<step>:0..#chosen_ids-1:
# status 1 ready, 0 not ready (missing groups), -1 step already committed (bound: the committed step),
# -2 step past the trainer's frontier + 1 (bound: the frontier; only with in_order).
SAMPLE = _HELPERS + """
local step, n, k, policy, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], ARGV[6]
local choice = p .. 'choice:' .. ARGV[2]
local recorded = redis.call('LRANGE', choice, 0, -1)
if #recorded > 0 then
  return {1, 0, {}, recorded, 1, {}}
end
local committed = num('committed')
if step <= committed then
  return {-1, committed, {}, {}, 0, {}}
end
if ARGV[7] == '1' and step > frontier() + 1 then
  return {-2, frontier(), {}, {}, 0, {}}
end
-- Stale for this step means stale for every later one: steps only grow.
local stale = redis.call('ZRANGEBYSCORE', p .. 'ver', '-inf', '(' .. string.format('%d', step - k))
for _, id in ipairs(stale) do
  redis.call('DEL', p .. 'g:' .. id)
  bury(id, ttl)
end
unindex(stale)
if #stale > 0 then
  redis.call('INCRBY', p .. 'n:stale', #stale)
  each_chunk(stale, function(...) redis.call('RPUSH', p .. 'stale:outbox', ...) end)
end
local eligible = redis.call('ZCOUNT', p .. 'ver', '-inf', string.format('%d', step))
if eligible < n then
  return {0, n - eligible, stale, {}, 0, {}}
end
local chosen, versions = {}, {}
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
  for i = 1, n do chosen[i], versions[i] = cands[i][1], cands[i][2] end
else
  -- Ingest order; groups newer than the step (version_start > step) wait their turn. The queue is read n ids
  -- at a time: they are nearly always all eligible, and reading it whole would cost O(buffer) every step.
  local from = 0
  while #chosen < n do
    local ids = redis.call('ZRANGE', p .. 'fifo', from, from + n - 1)
    if #ids == 0 then error('replay: fifo holds fewer eligible groups than ver counts') end
    for _, id in ipairs(ids) do
      local version = tonumber(redis.call('ZSCORE', p .. 'ver', id))
      if version <= step and #chosen < n then
        chosen[#chosen + 1], versions[#versions + 1] = id, version
      end
    end
    from = from + n
  end
end
each_chunk(chosen, function(...) redis.call('RPUSH', choice, ...) end)
redis.call('ZADD', p .. 'steps', step, ARGV[2])
unindex(chosen)
for i, id in ipairs(chosen) do redis.call('RENAME', p .. 'g:' .. id, p .. 'c:' .. ARGV[2] .. ':' .. (i - 1)) end
each_chunk(chosen, function(...) redis.call('SADD', p .. 'held', ...) end)
return {1, 0, stale, chosen, 0, versions}
"""

# ARGV: prefix, step, tombstone ttl, in_order ('1' | '0'). Deletes the choices of steps <= step and their groups.
# Returns {deleted, 0}, or with in_order and nothing touched: {-1, committed} behind the committed step,
# {-2, frontier} past the trainer's frontier, {-3, checkpointed} past the trainer's reported checkpoint.
COMMIT = _HELPERS + """
local step, ttl = tonumber(ARGV[2]), ARGV[3]
if ARGV[4] == '1' then
  if step < num('committed') then return {-1, num('committed')} end
  if step > frontier() then return {-2, frontier()} end
  if step > num('trainer:ckpt') then return {-3, num('trainer:ckpt')} end
end
local deleted = 0
for _, s in ipairs(redis.call('ZRANGEBYSCORE', p .. 'steps', '-inf', ARGV[2])) do
  local ids = redis.call('LRANGE', p .. 'choice:' .. s, 0, -1)
  for i, id in ipairs(ids) do
    deleted = deleted + redis.call('DEL', p .. 'c:' .. s .. ':' .. (i - 1))
    bury(id, ttl)
  end
  each_chunk(ids, function(...) redis.call('SREM', p .. 'held', ...) end)
  redis.call('DEL', p .. 'choice:' .. s)
end
redis.call('ZREMRANGEBYSCORE', p .. 'steps', '-inf', ARGV[2])
local committed = tonumber(redis.call('GET', p .. 'committed') or '-1')
if step > committed then redis.call('SET', p .. 'committed', ARGV[2]) end
return {deleted, 0}
"""

# ARGV: prefix, step, checkpoint_step (-1: none). Raises trainer:step and trainer:ckpt, never lowers them.
# Returns {trainer:step, trainer:ckpt} after the update.
REPORT = _HELPERS + """
local step, ckpt = tonumber(ARGV[2]), tonumber(ARGV[3])
ckpt = math.min(ckpt, step)  -- a checkpoint cannot cover a step not reported finished
if step > num('trainer:step') then redis.call('SET', p .. 'trainer:step', ARGV[2]) end
if ckpt > num('trainer:ckpt') then redis.call('SET', p .. 'trainer:ckpt', ARGV[3]) end
return {num('trainer:step'), num('trainer:ckpt')}
"""

# ARGV: prefix, marker, ttl. Counts one dead-lettered message once; returns 1 if new.
DEAD_LETTER = _HELPERS + """
if redis.call('SET', p .. 'dl:' .. ARGV[2], 1, 'NX', 'EX', ARGV[3]) then
  redis.call('INCR', p .. 'n:dead')
  return 1
end
return 0
"""

"""The replay buffer in Redis: idempotent puts, per-step batch choice, stale eviction, GC.

Every change runs as one Lua script (services/replay/scripts.py), so a crash of this process
or of Redis between two commands never leaves half an update. This module knows nothing of
NATS or gRPC; a new `ReplayStore` on the same Redis and run continues where the last one stopped.

Buffer lifecycle of a group:  put -> unchosen -> (chosen for step s | evicted as stale)
-> deleted when a checkpoint at step >= s is committed. Chosen and evicted ids keep a
tombstone for `tombstone_ttl_s`, so a late redelivery of the same group is not stored again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from services.replay import scripts

Policy = Literal["fifo", "freshest"]


class StepCommitted(ValueError):
    """Sample asked for a step whose checkpoint is committed; its batch was garbage-collected."""


class OutOfOrder(ValueError):
    """A Sample or Commit that the trainer's reported progress does not allow (in_order mode); nothing changed."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason
        """"ahead" (past the trainer's frontier), "behind" (before the committed step), "not checkpointed"."""


@dataclass(kw_only=True, slots=True)
class Put:
    """One group to store."""

    group_id: str
    version_start: int
    """Policy version the group's staleness is measured from."""
    finished_at_s: float
    """Unix seconds when rollout finished the group (drives oldest_age_seconds)."""
    payload: bytes
    """The serialized TrajectoryGroup, stored and returned unchanged."""


@dataclass(kw_only=True, slots=True)
class SampleResult:
    ready: bool
    missing: int = 0
    """Groups short of a full batch when not ready."""
    group_ids: list[str] = field(default_factory=list)
    """The batch, in selection order (empty when not ready)."""
    payloads: list[bytes] = field(default_factory=list)
    """Serialized TrajectoryGroups, aligned with group_ids."""
    stale_ids: list[str] = field(default_factory=list)
    """Groups evicted as stale by this call."""
    replayed: bool = False
    """True when the batch was recorded by an earlier call for the same step."""
    versions: list[int] = field(default_factory=list)
    """version_start of each newly chosen group (empty when replayed or not ready)."""


@dataclass(kw_only=True, slots=True)
class StoreStats:
    size: int
    """Stored, not yet chosen groups."""
    size_by_version: dict[int, int]
    stale_dropped: int
    oldest_finished_at_s: float | None
    """Unix seconds of the oldest unchosen group; None when empty."""
    dead_lettered: int
    duplicates: int


def key_prefix(run: str) -> str:
    """Namespace of one run; the hash tag keeps a run's keys in one cluster slot."""
    return f"flywheel:{{{run}}}:replay:"


class ReplayStore:
    """Thin async wrapper over the scripts; safe to use from many coroutines at once."""

    def __init__(self, redis: Redis, run: str, *, tombstone_ttl_s: int = 86400) -> None:
        self.redis = redis
        self.prefix = key_prefix(run)
        self.tombstone_ttl_s = tombstone_ttl_s
        self._put = redis.register_script(scripts.PUT)
        self._sample = redis.register_script(scripts.SAMPLE)
        self._commit = redis.register_script(scripts.COMMIT)
        self._dead = redis.register_script(scripts.DEAD_LETTER)
        self._report = redis.register_script(scripts.REPORT)

    async def put(self, item: Put) -> bool:
        """Store one group; False if its id was seen before (a duplicate)."""
        return (await self.put_many([item]))[0]

    async def put_many(self, items: Iterable[Put]) -> list[bool]:
        """Store groups in one round trip; True for each one stored, False for a duplicate.

        Each payload goes in by a plain SET, then one PUT script moves them all into place atomically (scripts.py:
        payloads never pass through Lua). A crash between the two leaves only expiring in:<id> keys; the messages
        are not acked, so they come back and are put again."""
        items = list(items)
        if not items:
            return []
        args = [self.prefix]
        for item in items:
            args += [item.group_id, item.version_start, repr(item.finished_at_s)]

        def commands(pipe: Pipeline) -> None:
            for item in items:
                pipe.set(self.prefix + "in:" + item.group_id, item.payload, ex=self.tombstone_ttl_s)
            pipe.evalsha(self._put.sha, 0, *args)

        return [bool(stored) for stored in (await self._pipeline(self._put, commands))[-1]]

    async def sample(self, step: int, n: int, max_staleness: int, policy: Policy = "fifo", *,
                     in_order: bool = False) -> SampleResult:
        """The batch for `step`: the recorded one if any, else a new full batch or not ready.

        `in_order`: refuse (OutOfOrder) a new step past the trainer's frontier + 1."""
        args = [self.prefix, str(step), n, max_staleness, policy, self.tombstone_ttl_s, int(in_order)]

        def commands(pipe: Pipeline) -> None:
            pipe.evalsha(self._sample.sha, 0, *args)
            pipe.mget(self._batch_keys(step, n))  # where the script leaves the batch: known before it runs

        (status, extra, stale, chosen, replayed, versions), payloads = await self._pipeline(self._sample, commands)
        if status == -1:
            raise StepCommitted(f"step {step} is at or below the committed checkpoint step {extra}")
        if status == -2:
            raise OutOfOrder(f"step {step} is ahead of the trainer: it has reached step {extra}, "
                             f"so the next step to sample is {extra + 1}", "ahead")
        if len(chosen) > n:  # a recorded batch larger than asked (only callers without the run's shape can ask)
            payloads = await self.redis.mget(self._batch_keys(step, len(chosen)))
        payloads = payloads[:len(chosen)]
        if None in payloads:  # only a Commit deletes a batch: one of this step ran between the script and the MGET
            raise StepCommitted(f"step {step} was committed while its batch was read")
        return SampleResult(ready=bool(status), missing=int(extra), group_ids=_strs(chosen), payloads=payloads,
                            stale_ids=_strs(stale), replayed=bool(replayed), versions=[int(v) for v in versions])

    def _batch_keys(self, step: int, n: int) -> list[str]:
        """Where SAMPLE puts step `step`'s batch (scripts.py)."""
        return [f"{self.prefix}c:{step}:{i}" for i in range(n)]

    async def _pipeline(self, script: AsyncScript, commands: Callable[[Pipeline], object]) -> list:
        """The replies of `commands` (which run `script` by EVALSHA), sent in one round trip. redis-py would ask
        SCRIPT EXISTS before each pipeline that runs a script (another round trip); instead the script is loaded
        when Redis answers NOSCRIPT (it keeps no scripts across a restart) and the commands are sent again."""

        async def send() -> list:
            pipe = self.redis.pipeline(transaction=False)
            commands(pipe)
            return await pipe.execute()

        try:
            return await send()
        except NoScriptError:
            await self.redis.script_load(script.script)
            return await send()

    async def stale_outbox(self) -> list[str]:
        """Ids evicted as stale (in eviction order) that are not yet announced to the controller."""
        return _strs(await self.redis.lrange(self.prefix + "stale:outbox", 0, -1))

    async def trim_stale_outbox(self, count: int) -> None:
        """The first `count` outbox ids were announced."""
        await self.redis.ltrim(self.prefix + "stale:outbox", count, -1)

    async def commit(self, step: int, *, in_order: bool = False) -> int:
        """Checkpoint at `step` committed: delete choices of steps <= step and their groups; the count deleted.

        `in_order`: refuse (OutOfOrder, nothing deleted) unless `step` is at or after the committed step,
        at most the trainer's frontier, and at most its reported checkpoint."""
        deleted, bound = await self._commit(args=[self.prefix, str(step), self.tombstone_ttl_s, int(in_order)])
        if deleted >= 0:
            return int(deleted)
        reason, message = {
            -1: ("behind", f"step {step} is behind the committed step {bound}: commits only move forward"),
            -2: ("ahead", f"step {step} is past the trainer's current step {bound}"),
            -3: ("not checkpointed", f"step {step} is past the trainer's last reported checkpoint (step {bound})"),
        }[deleted]
        raise OutOfOrder(message, reason)

    async def record_trainer(self, step: int, checkpoint_step: int | None = None) -> tuple[int, int]:
        """The trainer reported finishing `step` (and a checkpoint covering `checkpoint_step`): raise the
        frontier and the checkpoint bound. Returns (trainer step, checkpointed step); -1 when none."""
        ckpt = -1 if checkpoint_step is None else checkpoint_step
        step_now, ckpt = await self._report(args=[self.prefix, step, ckpt])
        return int(step_now), int(ckpt)

    async def trainer_progress(self) -> tuple[int, int]:
        """(reported step, reported checkpoint step); -1 for none."""
        step, ckpt = await self.redis.mget(self.prefix + "trainer:step", self.prefix + "trainer:ckpt")
        return int(step or -1), int(ckpt or -1)

    async def count_dead_letter(self, marker: str) -> bool:
        """Count one dead-lettered message, once per marker; True if it was new."""
        return bool(await self._dead(args=[self.prefix, marker, self.tombstone_ttl_s]))

    async def size(self) -> int:
        """Stored, not yet chosen groups (what the capacity bound counts)."""
        return int(await self.redis.zcard(self.prefix + "fifo"))

    async def stats(self) -> StoreStats:
        """One consistent snapshot (MULTI) of sizes and counters."""
        p = self.prefix
        pipe = self.redis.pipeline(transaction=True)
        pipe.zcard(p + "fifo")
        pipe.zrange(p + "ver", 0, -1, withscores=True)
        pipe.zrange(p + "fin", 0, 0, withscores=True)
        pipe.mget(p + "n:stale", p + "n:dead", p + "n:dup")
        size, versions, oldest, (stale, dead, dup) = await pipe.execute()
        by_version: dict[int, int] = {}
        for _, version in versions:
            by_version[int(version)] = by_version.get(int(version), 0) + 1
        return StoreStats(size=int(size), size_by_version=by_version, stale_dropped=int(stale or 0),
                          oldest_finished_at_s=float(oldest[0][1]) if oldest else None,
                          dead_lettered=int(dead or 0), duplicates=int(dup or 0))


def _strs(values: list) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in values]

"""The replay buffer in Redis: idempotent puts, per-step batch choice, stale eviction, GC.

Every change runs as one Lua script (services/replay/scripts.py), so a crash of this process
or of Redis between two commands never leaves half an update. This module knows nothing of
NATS or gRPC; a new `ReplayStore` on the same Redis and run continues where the last one stopped.

Buffer lifecycle of a group:  put -> unchosen -> (chosen for step s | evicted as stale)
-> deleted when a checkpoint at step >= s is committed. Chosen and evicted ids keep a
tombstone for `tombstone_ttl_s`, so a late redelivery of the same group is not stored again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from redis.asyncio import Redis

from services.replay import scripts

Policy = Literal["fifo", "freshest"]


class StepCommitted(ValueError):
    """Sample asked for a step whose checkpoint is committed; its batch was garbage-collected."""


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

    async def put(self, item: Put) -> bool:
        """Store one group; False if its id was seen before (a duplicate)."""
        return (await self.put_many([item]))[0]

    async def put_many(self, items: Iterable[Put]) -> list[bool]:
        """Store groups in one round trip; each put is atomic on its own."""
        pipe = self.redis.pipeline(transaction=False)
        for item in items:
            await self._put(args=[self.prefix, item.group_id, item.version_start, repr(item.finished_at_s),
                                  item.payload], client=pipe)
        return [bool(stored) for stored in await pipe.execute()]

    async def sample(self, step: int, n: int, max_staleness: int, policy: Policy = "fifo") -> SampleResult:
        """The batch for `step`: the recorded one if any, else a new full batch or not ready."""
        status, extra, stale, chosen, payloads, replayed, versions = await self._sample(
            args=[self.prefix, str(step), n, max_staleness, policy, self.tombstone_ttl_s])
        if status < 0:
            raise StepCommitted(f"step {step} is at or below the committed checkpoint step {extra}")
        return SampleResult(ready=bool(status), missing=int(extra), group_ids=_strs(chosen),
                            payloads=list(payloads), stale_ids=_strs(stale), replayed=bool(replayed),
                            versions=[int(v) for v in versions])

    async def commit(self, step: int) -> int:
        """Checkpoint at `step` committed: delete choices of steps <= step and their groups."""
        return int(await self._commit(args=[self.prefix, str(step), self.tombstone_ttl_s]))

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

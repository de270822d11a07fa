"""Oracles that read what the brokers hold, never what a service writes about itself (its logs, metrics.jsonl,
batches.jsonl, which the trainer rewrites on resume).

- JetStream's own state of the trajectory stream and replay's durable consumer: how many messages it stored
  (`last_seq`), whether any is still unacked (`messages`: a work-queue stream drops a message once acked),
  pending or redelivered.
- Replay's keys in Redis (key layout: services/replay/scripts.py): every group id replay ever stored is unchosen
  (`fifo`, payload at `g:<id>`), chosen for a step (`choice:<s>`, payload at `c:<s>:<i>`), or tombstoned (`d:<id>`,
  chosen-and-committed or evicted as stale). Payloads are decoded with the proto, so a record naming a group
  whose bytes are gone or another group's bytes is caught.
- `StepRecords`: each step's batch as replay recorded it in Redis, read while the run goes on (a Commit deletes the
  records of checkpointed steps), so a record that changes afterwards, a step never recorded, or a group in two
  steps' records is seen, and the trainer's consumed batches are compared with it. Redis's MONITOR stream of the
  RPUSHes that wrote each record backs the polls up: a record written and committed between two polls (the step
  before a checkpoint, on a loaded machine) is still seen.

What these cannot see: a group JetStream never stored (its publisher was told so and retries), and which ids a
publisher was acked (the stream drops acked messages; a per-id list of published groups still comes from the
publisher: the test itself in the service-level tests, rollout's log lines in the chaos run).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import nats
import redis

from services.common.bus import Subjects, nats_credentials
from services.common.config import SecurityConfig
from services.common.pb.flywheel.v1 import types_pb2
from services.replay.ingest import CONSUMER
from services.replay.store import key_prefix


@dataclass(frozen=True, slots=True)
class StreamState:
    """JetStream's view of the trajectory stream and replay's consumer."""

    stored: int
    """Messages the stream ever stored (its last sequence number)."""
    unacked: int
    """Messages still in the stream (work-queue retention removes a message once it is acked)."""
    pending: int
    """Messages not yet delivered to replay's consumer."""
    ack_pending: int
    """Delivered to replay, not acked."""
    redelivered: int


async def stream_state(nats_url: str, run: str, security: SecurityConfig | None = None) -> StreamState:
    nc = await nats.connect(nats_url, **nats_credentials(security or SecurityConfig()))
    try:
        js, stream = nc.jetstream(), Subjects(run).stream("traj")
        info, consumer = await js.stream_info(stream), await js.consumer_info(stream, CONSUMER)
        return StreamState(stored=info.state.last_seq, unacked=info.state.messages, pending=consumer.num_pending,
                           ack_pending=consumer.num_ack_pending, redelivered=consumer.num_redelivered)
    finally:
        await nc.close()


def read_stream_state(nats_url: str, run: str, security: SecurityConfig | None = None) -> StreamState:
    return asyncio.run(stream_state(nats_url, run, security))


@dataclass(slots=True)
class RedisLedger:
    """Replay's keys of one run, as Redis holds them."""

    unchosen: set[str] = field(default_factory=set)
    choices: dict[int, list[str]] = field(default_factory=dict)
    """Steps not yet committed -> the ids replay chose for them, in order."""
    buried: set[str] = field(default_factory=set)
    duplicates: int = 0
    dead_lettered: int = 0
    damaged: list[str] = field(default_factory=list)
    """Records whose payload is missing or is another group's, or whose version tags run backwards."""
    spanning: int = 0
    """Completions sampled across a weight update (version_end > version_start): in-flight updates happened."""

    def ids(self) -> set[str]:
        """Every group id replay stored and Redis still accounts for."""
        return self.unchosen | self.buried | {i for ids in self.choices.values() for i in ids}


def consumed_groups(redis_url: str, cfg) -> list[types_pb2.TrajectoryGroup]:
    """The groups of every step's batch of a run, as replay handed them to the trainer (its `c:` records)."""
    return [g for groups in consumed_steps(redis_url, cfg).values() for g in groups]


def consumed_steps(redis_url: str, cfg) -> dict[int, list[types_pb2.TrajectoryGroup]]:
    """Step -> the groups of its batch, as replay handed them to the trainer (its `c:<step>:<i>` records)."""
    client = redis.Redis.from_url(redis_url, password=cfg.security.redis_password.get_secret_value() or None)
    prefix = f"{key_prefix(cfg.run.name)}c:"
    steps: dict[int, list[types_pb2.TrajectoryGroup]] = {}
    for key in sorted(client.scan_iter(f"{prefix}*")):
        step, _ = key.decode()[len(prefix):].split(":")
        steps.setdefault(int(step), []).append(types_pb2.TrajectoryGroup.FromString(client.get(key)))
    return dict(sorted(steps.items()))


def read_ledger(client: redis.Redis, run: str) -> RedisLedger:
    """`client` must not decode responses (payloads are bytes)."""
    p = key_prefix(run)
    ledger = RedisLedger(duplicates=int(client.get(p + "n:dup") or 0), dead_lettered=int(client.get(p + "n:dead") or 0))
    ledger.unchosen = {i.decode() for i in client.zrange(p + "fifo", 0, -1)}
    ledger.buried = {k.decode()[len(p) + 2:] for k in client.scan_iter(match=p + "d:*", count=1000)}
    for step in (int(s) for s in client.zrange(p + "steps", 0, -1)):
        ledger.choices[step] = [i.decode() for i in client.lrange(f"{p}choice:{step}", 0, -1)]
    for gid in sorted(ledger.unchosen):
        _check_payload(ledger, f"unchosen {gid}", client.get(p + "g:" + gid), gid)
    for step, ids in ledger.choices.items():
        for i, gid in enumerate(ids):
            _check_payload(ledger, f"step {step}'s group {i} ({gid})", client.get(f"{p}c:{step}:{i}"), gid)
    return ledger


def _check_payload(ledger: RedisLedger, what: str, payload: bytes | None, gid: str) -> None:
    if payload is None:
        ledger.damaged.append(f"{what}: no payload")
        return
    group = types_pb2.TrajectoryGroup.FromString(payload)
    if group.group_id != gid:
        ledger.damaged.append(f"{what}: the payload is another group's")
    ledger.damaged += [f"{what}: {v}" for v in version_problems(group)]
    ledger.spanning += sum(c.version_end > c.version_start for c in group.completions)


def version_problems(group: types_pb2.TrajectoryGroup) -> list[str]:
    """A completion's version tags run forwards (an in-flight update only ever loads newer weights, a restarted
    worker included), and the group's staleness is measured from its oldest completion."""
    out = [f"completion {i} sampled from version {c.version_start} to an older {c.version_end}"
           for i, c in enumerate(group.completions) if c.version_end < c.version_start]
    if group.completions and group.version_start != min(c.version_start for c in group.completions):
        out.append(f"version_start {group.version_start} is not its oldest completion's")
    return out


def lost(published: set[str], ledger: RedisLedger) -> set[str]:
    """Ids a publisher was acked for that Redis does not account for (dropped between the ack and the write)."""
    return published - ledger.ids()


def balance(stream: StreamState, ledger: RedisLedger) -> list[str]:
    """What does not add up between JetStream and Redis once the run is quiet; empty when it balances.
    Every stored message was either stored in Redis as a new id, refused as a duplicate or dead-lettered; a
    redelivery after a crash is counted as a duplicate again, so the sum may exceed what JetStream stored."""
    problems = [f"damaged record: {d}" for d in ledger.damaged]
    if (stream.unacked, stream.pending, stream.ack_pending) != (0, 0, 0):
        problems.append(f"JetStream still holds groups replay has not acked: {stream}")
    held = len(ledger.ids())
    if held > stream.stored:
        problems.append(f"Redis holds {held} groups, more than the {stream.stored} messages JetStream stored")
    if held + ledger.duplicates + ledger.dead_lettered < stream.stored:
        problems.append(f"JetStream stored {stream.stored} messages; Redis accounts for {held} groups, "
                        f"{ledger.duplicates} duplicates and {ledger.dead_lettered} dead letters: groups were "
                        "dropped after replay acked them")
    return problems


class StepRecords:
    """Replay's record of each step's batch (`choice:<s>` in Redis), as first seen by `poll`, and every later
    change to it. Poll more often than checkpoints commit (a Commit deletes the records it covers)."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.prefix = key_prefix(run)
        self.first: dict[int, list[str]] = {}
        self.rewritten: dict[int, list[str]] = {}
        self.pushed: dict[int, list[str]] = {}
        """Each step's ids as MONITOR saw them pushed, until the record was first deleted."""
        self._closed: set[int] = set()

    def monitor(self, done) -> None:
        """Follows MONITOR until `done` is set (a threading.Event), reconnecting while Redis restarts. Commands a
        Lua script runs are in the stream, so replay's RPUSHes and a Commit's DELs of `choice:<s>` are seen."""
        kwargs = self.client.connection_pool.connection_kwargs
        watcher = redis.Redis(host=kwargs["host"], port=kwargs["port"], password=kwargs.get("password"),
                              socket_timeout=5.0)
        record = self.prefix + "choice:"
        while not done.is_set():
            try:
                with watcher.monitor() as stream:
                    while not done.is_set():
                        op, key, *ids = stream.next_command()["command"].split(" ") + [""]
                        if not key.startswith(record):
                            continue
                        step = int(key.rsplit(":", 1)[1])
                        if op.upper() == "RPUSH" and step not in self._closed:
                            self.pushed.setdefault(step, []).extend(i for i in ids if i)
                        elif op.upper() == "DEL":
                            self._closed.add(step)
            except (redis.exceptions.RedisError, OSError, ValueError):
                done.wait(0.2)  # a read timeout with nothing to see, or Redis killed and restarting

    def poll(self) -> None:
        for key in self.client.scan_iter(match=self.prefix + "choice:*", count=1000):
            step = int(key.decode().rsplit(":", 1)[1])
            ids = [i.decode() for i in self.client.lrange(key, 0, -1)]
            if not ids:
                continue  # deleted by a Commit between the scan and the read
            seen = self.first.setdefault(step, ids)
            if ids != seen:
                self.rewritten[step] = ids

    def problems(self, steps: int, trained: dict[int, list[str]]) -> list[str]:
        """Steps 0..steps-1 each recorded once and never changed, no group in two steps' records, and the
        trainer's consumed batch of each step (`trained`) the one replay recorded."""
        for step, ids in self.pushed.items():
            self.first.setdefault(step, ids)  # written and committed between two polls
        out = [f"step {s}'s record changed from {self.first[s][:2]}... to {ids[:2]}..."
               for s, ids in sorted(self.rewritten.items())]
        if sorted(self.first) != list(range(steps)):
            missing = sorted(set(range(steps)) - set(self.first))
            extra = sorted(set(self.first) - set(range(steps)))
            out.append(f"replay's records cover steps {missing} missing, {extra} extra")
        owner: dict[str, int] = {}
        for step, ids in sorted(self.first.items()):
            for gid in ids:
                if gid in owner or ids.count(gid) > 1:
                    out.append(f"group {gid} served in step {owner.get(gid, step)} and again in step {step}")
                owner[gid] = step
        out += [f"the trainer's batch for step {s} is not the one replay recorded"
                for s in sorted(trained) if trained[s] != self.first.get(s)]
        return out

"""Trajectory ingest: the JetStream pull consumer that moves finished groups into Redis.

    trajectory stream (work queue) --fetch--> decode/check --put (Lua, idempotent)--> ack
                                                   └─ malformed --> dead-letter subject --> ack

Two stages: while one batch is written to Redis and acked, the next is fetched and checked, so
NATS and Redis work at the same time (done one after the other, each waited for the other).
Delivery is at least once: a message is acked only after its Redis write, and a
redelivered group is recognised by its id and counted as a duplicate, never stored twice.
Back-pressure: while the unchosen groups (stored, or being written) reach `replay.capacity_groups`,
nothing is fetched, so the surplus waits in JetStream (durable) rather than in this process.
With dynamic sampling (grpo.use_dynamic_sampling), a group whose rewards are all equal is not
stored: its id goes to the controller (subject replay.filtered, in the EVENTS stream), which leases a
new prompt to refill the step, and the message is acked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import nats.errors
import redis.exceptions
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry import trace

from services.common.bus import Bus
from services.common.config import ReplayConfig, RewardScalingConfig
from services.common.pb.flywheel.v1 import types_pb2
from services.common.telemetry import extract_context
from services.replay.metrics import BUFFER_GROUPS, DEAD_LETTERS, DUPLICATES, FILTERED, INGESTED
from services.replay.pulse import Pulse
from services.replay.store import Put, ReplayStore
from services.replay.validate import Malformed, decode_group, zero_variance

log = logging.getLogger("flywheel.replay.ingest")
tracer = trace.get_tracer("flywheel.replay")

CONSUMER = "replay"
FETCH_TIMEOUT_S = 0.5  # bounds how long a stop request waits for an idle fetch
FULL_POLL_S = 0.5  # re-check a full buffer this often even without a wake-up (another instance may free it)
REDIS_RETRY_S = 0.5
REASON_HEADER = "Flywheel-Dead-Letter-Reason"
SOURCE_HEADER = "Flywheel-Source-Subject"
TRUNCATED_HEADER = "Flywheel-Dead-Letter-Truncated-From"
"""Set on a dead letter cut to fit max_payload with its headers: the original size in bytes."""
HEADER_ROOM = 4096
"""Bytes of a dead letter kept for its headers (NATS counts them in max_payload)."""


@dataclass(slots=True)
class Batch:
    """Fetched messages that passed the checks, with what to store for each; the rest are already handled."""

    msgs: list[Msg] = field(default_factory=list)
    puts: list[Put] = field(default_factory=list)
    spans: list[trace.Span] = field(default_factory=list)


class Ingest:
    """Runs until `stop` is set; `space` is set by whoever frees buffer room (Sample); `stored` fires after
    every write that stored a new group."""

    def __init__(self, bus: Bus, store: ReplayStore, cfg: ReplayConfig, space: asyncio.Event | None = None, *,
                 drop_zero_variance: bool = False, reward_scaling: RewardScalingConfig | None = None,
                 stored: Pulse | None = None) -> None:
        self.drop_zero_variance = drop_zero_variance
        """grpo.use_dynamic_sampling: groups with equal rewards (after grpo.reward_scaling) are filtered out here."""
        self.reward_scaling = reward_scaling
        self.bus = bus
        self.store = store
        self.cfg = cfg
        self.space = space or asyncio.Event()
        self.stored = stored or Pulse()
        self._writing = 0
        """Groups of the write in progress: not in the store's size yet, but they take room."""
        self._backlog = 0
        """Messages the stream held beyond the last one fetched, when it was delivered."""

    async def subscribe(self):
        """Create or update the durable consumer (ack_wait may change between runs), hand back what a killed
        predecessor held, then bind."""
        stream = self.bus.subjects.stream("traj")
        await self.bus.js.add_consumer(stream, ConsumerConfig(
            name=CONSUMER, durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=self.cfg.ack_wait_s,
            filter_subject=self.bus.subjects.trajectories))
        # Groups delivered to a replay that died before acking (a SIGKILL between fetch and ack, or a fetch the
        # server filled just as it died). Left to ack_wait, such a group reaches Redis ack_wait_s later, after the
        # trainer filled its step from later groups: it is evicted as stale and its prompt leased again, and the
        # run's last step waits for that. Handed back now, it is stored as soon as this replay serves. A second
        # replay sharing the consumer would see its in-flight groups delivered again: stored once (puts are
        # idempotent), counted as duplicates.
        await self.bus.take_back(stream, CONSUMER)
        return await self.bus.js.pull_subscribe_bind(durable=CONSUMER, stream=stream)

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and check the next batch while the last one is written; one write at a time, in fetch order."""
        sub = await self.subscribe()
        writing: asyncio.Task | None = None
        try:
            while not stop.is_set():
                try:
                    batch = await self._fetch(sub, stop)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
                    log.warning("redis unavailable, ingest paused: %s", err)
                    await _wait_any(stop, timeout=REDIS_RETRY_S)
                    continue
                if writing:
                    await writing
                    writing = None
                if batch.puts:
                    self._writing = len(batch.puts)
                    writing = asyncio.create_task(self._write(batch, stop))
        finally:
            if writing:
                await writing  # stop: the batch in hand is written and acked, not left for ack_wait
            await sub.unsubscribe()

    async def _fetch(self, sub, stop: asyncio.Event) -> Batch:
        """The next batch to write: fetched within the free room, decoded and checked; malformed messages are
        dead-lettered and filtered ones announced (both acked) here."""
        room = await self._room(stop)
        if room <= 0:
            return Batch()
        # Ask for no more than the stream is known to hold: a pull that the server cannot fill at once stays open
        # until its timeout, holding what it got (a group that arrives as a fetch starts could wait FETCH_TIMEOUT_S).
        # Nothing known: ask for one, which returns the moment it arrives.
        want = min(self.cfg.fetch_batch, room, max(1, self._backlog))
        try:
            msgs = await sub.fetch(want, timeout=FETCH_TIMEOUT_S)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either, depending on the path
            return Batch()
        self._backlog = msgs[-1].metadata.num_pending
        try:
            return await self._check(msgs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            await _nak(msgs)
            raise

    async def _room(self, stop: asyncio.Event) -> int:
        """Free slots below capacity; when none, wait for a wake-up (or the poll) and report 0."""
        self.space.clear()  # before the size check, so a Sample that frees room after it still wakes us
        writing = self._writing  # before the size: a write that ends in between is counted twice, never missed
        size = await self.store.size()
        BUFFER_GROUPS.set(size)
        room = self.cfg.capacity_groups - size - writing
        if room <= 0:
            await _wait_any(stop, self.space, timeout=FULL_POLL_S)
        return room

    async def _check(self, msgs: list[Msg]) -> Batch:
        batch = Batch()
        for msg in msgs:
            try:
                group = decode_group(msg.data)
            except Malformed as err:
                await self._dead_letter(msg, str(err))
                continue
            if self.drop_zero_variance and zero_variance(group, self.reward_scaling):
                await self.bus.publish(self.bus.subjects.filtered, types_pb2.StaleGroups(group_ids=[group.group_id]),
                                       msg_id=f"filtered:{group.group_id}")  # JetStream: survives a controller restart
                FILTERED.inc()
                await msg.ack()
                continue
            finished = group.finished_at_unix_ns / 1e9 if group.finished_at_unix_ns else time.time()
            batch.msgs.append(msg)
            batch.puts.append(Put(group_id=group.group_id, version_start=group.version_start,
                                  finished_at_s=finished, payload=msg.data))
            batch.spans.append(tracer.start_span("replay.ingest", context=extract_context(msg.headers),
                                                 attributes={"flywheel.group_id": group.group_id,
                                                             "flywheel.version_start": group.version_start}))
        return batch

    async def _write(self, batch: Batch, stop: asyncio.Event) -> None:
        """Store the batch in one round trip, then ack it. If Redis is down, hand the messages back at once."""
        stored: list[bool] = []
        try:
            stored = await self.store.put_many(batch.puts)
            for msg, span, new in zip(batch.msgs, batch.spans, stored):
                await msg.ack()  # only now: the group is in Redis
                span.set_attribute("flywheel.duplicate", not new)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
            await _nak(batch.msgs)  # not after ack_wait: a group that waits that long may miss its step
            log.warning("redis unavailable, ingest paused: %s", err)
            await _wait_any(stop, timeout=REDIS_RETRY_S)
        finally:
            self._writing = 0
            self.space.set()  # duplicates take no room: a fetch that waits for room looks again
            for span in batch.spans:
                span.end()
        INGESTED.inc(sum(stored))
        DUPLICATES.inc(len(stored) - sum(stored))
        if any(stored):
            self.stored.fire()

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        """Publish the raw bytes with the reason, count once per stream message, ack."""
        reason = " ".join(reason.split())[:300]
        meta = msg.metadata
        marker = f"{meta.stream}:{meta.sequence.stream}"
        headers = {REASON_HEADER: reason, SOURCE_HEADER: msg.subject, "Nats-Msg-Id": f"dl:{marker}"}
        data, room = msg.data, self.bus.nc.max_payload - HEADER_ROOM
        if len(data) > room:  # the bytes plus our headers would pass max_payload: the server would drop us
            data, headers[TRUNCATED_HEADER] = data[:room], str(len(data))
        await self.bus.js.publish(self.bus.subjects.dead_letter, data, headers=headers)
        if await self.store.count_dead_letter(marker):
            DEAD_LETTERS.inc()
        log.warning("dead-lettered %s: %s", marker, reason)
        await msg.ack()


async def _nak(msgs: list[Msg]) -> None:
    for msg in msgs:
        with contextlib.suppress(nats.errors.Error):  # already acked, or NATS down too (then ack_wait)
            await msg.nak(delay=REDIS_RETRY_S)


async def _wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Return when any event is set or after `timeout` seconds."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()

"""Trajectory ingest: the JetStream pull consumer that moves finished groups into Redis.

    trajectory stream (work queue) --fetch--> decode/check --put (Lua, idempotent)--> ack
                                                   └─ malformed --> dead-letter subject --> ack

Delivery is at least once: a message is acked only after its Redis write, and a
redelivered group is recognised by its id and counted as a duplicate, never stored twice.
Back-pressure: while the unchosen groups reach `replay.capacity_groups`, nothing is
fetched, so the surplus waits in JetStream (durable) rather than in this process.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import redis.exceptions
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry import trace

from services.common.bus import Bus
from services.common.config import ReplayConfig
from services.common.telemetry import extract_context
from services.replay.metrics import BUFFER_GROUPS, DEAD_LETTERS, DUPLICATES, INGESTED
from services.replay.store import Put, ReplayStore
from services.replay.validate import Malformed, decode_group

log = logging.getLogger("flywheel.replay.ingest")
tracer = trace.get_tracer("flywheel.replay")

CONSUMER = "replay"
FETCH_TIMEOUT_S = 0.5  # bounds how long a stop request waits for an idle fetch
FULL_POLL_S = 0.5  # re-check a full buffer this often even without a wake-up (another instance may free it)
REDIS_RETRY_S = 0.5
REASON_HEADER = "Flywheel-Dead-Letter-Reason"
SOURCE_HEADER = "Flywheel-Source-Subject"


class Ingest:
    """Runs until `stop` is set; `space` is set by whoever frees buffer room (Sample)."""

    def __init__(self, bus: Bus, store: ReplayStore, cfg: ReplayConfig, space: asyncio.Event | None = None) -> None:
        self.bus = bus
        self.store = store
        self.cfg = cfg
        self.space = space or asyncio.Event()

    async def subscribe(self):
        """Create or update the durable consumer (ack_wait may change between runs), then bind."""
        stream = self.bus.subjects.stream("traj")
        await self.bus.js.add_consumer(stream, ConsumerConfig(
            name=CONSUMER, durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=self.cfg.ack_wait_s,
            filter_subject=self.bus.subjects.trajectories))
        return await self.bus.js.pull_subscribe_bind(durable=CONSUMER, stream=stream)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.subscribe()
        try:
            while not stop.is_set():
                try:
                    await self._step(sub, stop)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
                    # Redis restarting: unacked messages stay in JetStream; try again shortly.
                    log.warning("redis unavailable, ingest paused: %s", err)
                    await _wait_any(stop, timeout=REDIS_RETRY_S)
        finally:
            await sub.unsubscribe()

    async def _step(self, sub, stop: asyncio.Event) -> None:
        room = await self._room(stop)
        if room <= 0:
            return
        try:
            msgs = await sub.fetch(min(self.cfg.fetch_batch, room), timeout=FETCH_TIMEOUT_S)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either, depending on the path
            return
        await self.handle(msgs)

    async def _room(self, stop: asyncio.Event) -> int:
        """Free slots below capacity; when none, wait for a wake-up (or the poll) and report 0."""
        self.space.clear()  # before the size check, so a Sample that frees room after it still wakes us
        size = await self.store.size()
        BUFFER_GROUPS.set(size)
        room = self.cfg.capacity_groups - size
        if room <= 0:
            await _wait_any(stop, self.space, timeout=FULL_POLL_S)
        return room

    async def handle(self, msgs: list[Msg]) -> None:
        """Store the good messages in one round trip, dead-letter the bad ones, then ack all."""
        good: list[tuple[Msg, Put, trace.Span]] = []
        for msg in msgs:
            try:
                group = decode_group(msg.data)
            except Malformed as err:
                await self._dead_letter(msg, str(err))
                continue
            span = tracer.start_span("replay.ingest", context=extract_context(msg.headers),
                                     attributes={"flywheel.group_id": group.group_id,
                                                 "flywheel.version_start": group.version_start})
            finished = group.finished_at_unix_ns / 1e9 if group.finished_at_unix_ns else time.time()
            good.append((msg, Put(group_id=group.group_id, version_start=group.version_start,
                                  finished_at_s=finished, payload=msg.data), span))
        if not good:
            return
        try:
            stored = await self.store.put_many(put for _, put, _ in good)
        except BaseException:
            for *_, span in good:
                span.end()
            raise
        for (msg, _, span), new in zip(good, stored):
            await msg.ack()  # only now: the group is in Redis
            span.set_attribute("flywheel.duplicate", not new)
            span.end()
        INGESTED.inc(sum(stored))
        DUPLICATES.inc(len(stored) - sum(stored))

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        """Publish the raw bytes with the reason, count once per stream message, ack."""
        reason = " ".join(reason.split())[:300]
        meta = msg.metadata
        marker = f"{meta.stream}:{meta.sequence.stream}"
        headers = {REASON_HEADER: reason, SOURCE_HEADER: msg.subject, "Nats-Msg-Id": f"dl:{marker}"}
        await self.bus.js.publish(self.bus.subjects.dead_letter, msg.data, headers=headers)
        if await self.store.count_dead_letter(marker):
            DEAD_LETTERS.inc()
        log.warning("dead-lettered %s: %s", marker, reason)
        await msg.ack()


async def _wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Return when any event is set or after `timeout` seconds."""
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()

"""The NATS JetStream bus: subject names, streams (created idempotently), typed publish.

Streams per run (names derive from the run id, so runs share a server safely):
- WORK: the rollout work queue (work-queue retention: a message is gone once acked;
  unacked messages are redelivered after `ack_wait`, which is how a killed rollout
  worker's groups come back).
- TRAJ: finished trajectory groups (work-queue retention; replay acks after its Redis write).
- STATE: last-value subjects (weight announcements), so a late joiner reads the latest.
Heartbeats, confirmations and step reports are plain core-NATS events.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import nats
from google.protobuf.message import Message
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from services.common.telemetry import inject_headers

# nats-py waits up to 30 s by default; a service must stop within 5 s of SIGTERM, and on
# loopback a second is ample to flush what is pending (unacked work is redelivered anyway).
DRAIN_TIMEOUT_S = 1


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject and stream names of one run."""

    run: str

    @property
    def _token(self) -> str:
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.run)

    @property
    def work(self) -> str:
        return f"flywheel.{self._token}.work"

    @property
    def trajectories(self) -> str:
        return f"flywheel.{self._token}.trajectories"

    @property
    def weights_announce(self) -> str:
        return f"flywheel.{self._token}.weights.announce"

    @property
    def weights_loaded(self) -> str:
        return f"flywheel.{self._token}.weights.loaded"

    @property
    def heartbeat(self) -> str:
        return f"flywheel.{self._token}.rollout.heartbeat"

    @property
    def train_step(self) -> str:
        return f"flywheel.{self._token}.train.step"

    @property
    def stale(self) -> str:
        return f"flywheel.{self._token}.replay.stale"

    @property
    def dead_letter(self) -> str:
        return f"flywheel.{self._token}.deadletter"

    def stream(self, kind: str) -> str:
        return f"FLYWHEEL_{self._token}_{kind}".upper().replace("-", "_")


class Bus:
    """One NATS connection plus JetStream context for a service."""

    def __init__(self, nc: Client, run: str) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subjects = Subjects(run)

    @classmethod
    async def connect(cls, url: str, run: str, *, name: str = "flywheel") -> Bus:
        nc = await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                drain_timeout=DRAIN_TIMEOUT_S)
        bus = cls(nc, run)
        await bus.ensure_streams()
        return bus

    async def ensure_streams(self) -> None:
        s = self.subjects
        await self._ensure(StreamConfig(name=s.stream("work"), subjects=[s.work],
                                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        await self._ensure(StreamConfig(name=s.stream("traj"), subjects=[s.trajectories],
                                        retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE))
        await self._ensure(StreamConfig(name=s.stream("state"), subjects=[s.weights_announce, s.dead_letter],
                                        max_msgs_per_subject=1, storage=StorageType.FILE))

    async def _ensure(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except BadRequestError as err:  # exists with another config: keep it, update subjects
            if err.err_code != 10058:
                raise
            await self.js.update_stream(config)

    async def publish(self, subject: str, msg: Message, *, msg_id: str | None = None) -> None:
        """JetStream publish; returns once the server has stored it. msg_id dedups retries."""
        headers = inject_headers()
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        await self.js.publish(subject, msg.SerializeToString(), headers=headers or None)

    async def emit(self, subject: str, msg: Message) -> None:
        """Fire-and-forget core NATS event."""
        await self.nc.publish(subject, msg.SerializeToString(), headers=inject_headers() or None)

    async def close(self) -> None:
        await self.nc.drain()

"""What replay knows of the trainer's progress: its StepReports, kept in Redis.

    trainer --StepReport(step, checkpoint_step)--> flywheel.<run>.train.step --> ReplayStore.record_trainer

The reported step and checkpoint only ever rise (services/replay/scripts.py, REPORT), and they
bound what Sample and Commit accept (store `in_order`): no caller can sample past the trainer or
commit a step the trainer has not checkpointed. The subject is core NATS, so a report sent while
replay is down is missed; the next one (every step) catches up, and a Commit refused meanwhile
only delays garbage collection until the trainer's next checkpoint.
"""

from __future__ import annotations

import asyncio
import logging

from google.protobuf.message import DecodeError

from services.common.bus import Bus
from services.common.logs import RateLimitedLog
from services.common.pb.flywheel.v1 import types_pb2
from services.replay.pulse import Pulse
from services.replay.store import ReplayStore

log = logging.getLogger("flywheel.replay.reports")


class TrainerReports:
    """Subscribes to the trainer's step reports until `stop` is set; `recorded` fires after each one is in Redis."""

    def __init__(self, bus: Bus, store: ReplayStore, recorded: Pulse | None = None) -> None:
        self.bus = bus
        self.store = store
        self.recorded = recorded or Pulse()
        self.warn = RateLimitedLog(log)

    async def handle(self, data: bytes) -> None:
        try:
            report = types_pb2.StepReport.FromString(data)
        except DecodeError as err:
            self.warn.warning("undecodable", "ignored an undecodable step report: %s", err)
            return
        if report.step < 0:
            self.warn.warning("negative", "ignored a step report for step %d", report.step)
            return
        checkpoint = report.checkpoint_step if report.HasField("checkpoint_step") else None
        await self.store.record_trainer(report.step, checkpoint)
        self.recorded.fire()

    async def run(self, stop: asyncio.Event) -> None:
        async def on_report(msg) -> None:
            await self.handle(msg.data)

        sub = await self.bus.nc.subscribe(self.bus.subjects.train_step, cb=on_report)
        try:
            await stop.wait()
        finally:
            await sub.unsubscribe()

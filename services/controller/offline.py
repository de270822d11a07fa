"""The controller of an offline run (SFT, DPO, RM): publishes dataset rows as groups to the trajectory stream.

    data.train ──load_plan (tokenized, chat template)──▶ step t's rows ──▶ TrajectoryGroups ──▶ trajectory stream
    trainer StepReport ──▶ trained_step ──▶ admission: publish step t while t <= trained_step + 1 + k

There is no rollout: the groups take the path rollout's take (replay ingests them, Sample(t) serves
exactly step t's, Commit frees them), so exactly-once, resume and the audit trail are GRPO's. A group
for step t has version_start t, so replay never serves it to an earlier step. Back-pressure is GRPO's
admission rule with the trainer's version in place of rollout's: at most (k + 1) steps are published
and not yet trained. The next step to publish is saved in the run's state (state.py) after each
window; a controller killed before saving publishes that window again with the same group ids, which
JetStream's duplicate window and replay's id check drop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.bus import Bus
from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from services.common.server import run_service
from services.controller import auth
from services.controller.admission import leasable_targets
from services.common.data.offline_tokens import OfflinePlan, group_id, group_of, load_plan
from services.controller.reporting import Reporting
from services.controller.state import RunState, StateStore
from services.controller.tracking import Tracker

log = logging.getLogger("flywheel.controller")


class OfflinePublisher:
    def __init__(self, cfg: FlywheelConfig, bus: Bus, plan: OfflinePlan, state: StateStore | None = None,
                 reporting: Reporting | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.plan = plan
        self.state = state
        self.reporting = reporting
        """Step reports to the trackers (TensorBoard, W&B, MLflow), as under GRPO."""
        self.trained_step = -1
        self.next_target = 0
        self.wake = asyncio.Event()

    async def resume(self) -> None:
        saved = await self.state.load() if self.state is not None else None
        if saved is not None:
            self.next_target = saved.next_target
            log.info("resumed an offline run: next step to publish %d", self.next_target)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.nc.subscribe(self.bus.subjects.train_step, cb=self._on_step)
        try:
            while not stop.is_set():
                await self.publish_window()
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            await sub.unsubscribe()

    async def publish_window(self) -> None:
        """Every step the admission rule allows now, in order, each step's groups one after another (so replay
        ingests them in the plan's order)."""
        k = self.cfg.grpo.max_staleness
        for step in leasable_targets(self.next_target, self.trained_step + 1, k, self.plan.steps):
            now = time.time_ns()
            for i, row in enumerate(self.plan.rows(step)):
                gid = group_id(self.cfg.run.name, self.cfg.run.seed, step, i)
                group = group_of(row, group_id=gid, step=step, env_name=self.cfg.algorithm, now_ns=now)
                await self.bus.publish(self.bus.subjects.trajectories, group, msg_id=gid)
            self.next_target = step + 1
            if self.state is not None:
                await self.state.save(RunState(next_target=self.next_target))

    async def _on_step(self, msg) -> None:
        report = types_pb2.StepReport.FromString(msg.data)
        if 0 <= report.step < self.plan.steps:
            self.trained_step = max(self.trained_step, report.step)
            self.wake.set()
            if self.reporting is not None:
                await self.reporting.on_step(report)

    def status(self) -> controller_pb2.StatusResponse:
        return controller_pb2.StatusResponse(
            loaded_version=self.trained_step + 1, trained_step=self.trained_step, next_target_step=self.next_target,
            done=self.trained_step + 1 >= self.plan.steps)


class OfflineServicer(controller_pb2_grpc.ControllerServiceServicer):
    """Status only: an offline run has no environment mix to submit to or list."""

    def __init__(self, publisher: OfflinePublisher) -> None:
        self.p = publisher

    async def Status(self, request, context):
        return self.p.status()


async def serve_offline(cfg: FlywheelConfig, bus: Bus) -> None:
    """The controller's service for an offline run: the plan, its drops logged, then the publisher."""
    # Imported here: transformers and what it pulls in were 1.8 s of CPU at every controller start (2.5 s of
    # imports, 0.7 s without), and a GRPO run never tokenizes.
    from services.common.tokenizing import load_tokenizer_without_torch

    plan, _, lines = load_plan(cfg, load_tokenizer_without_torch(cfg.policy))
    for line in lines:
        log.info("%s", line)
    log.info("%s: %d steps of %d examples", cfg.algorithm, plan.steps, plan.per_step)
    reporting = Reporting(cfg, Tracker(cfg), None)
    publisher = OfflinePublisher(cfg, bus, plan, await StateStore.open(bus.js, cfg.run.name), reporting)
    await publisher.resume()
    try:
        await run_service("controller", cfg.addresses.controller,
                          lambda server: controller_pb2_grpc.add_ControllerServiceServicer_to_server(
                              OfflineServicer(publisher), server), publisher.run,
                          interceptors=auth.interceptors(cfg.controller.auth_token),
                          security=cfg.security, public=auth.PUBLIC)
    finally:
        await reporting.close()

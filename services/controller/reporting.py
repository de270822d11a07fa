"""The run's reports, as the controller sees them: trainer StepReports and rollout weight loads in,
tracker rows (TensorBoard, W&B, MLflow) and validation requests out.

    StepReport(s) ──▶ train/* + timing/* + train/buffer_size (replay Stats) ──▶ Tracker at step s + 1
                  └─▶ grpo.validation_due(s + 1)? ──▶ ValidationLoop.request(s + 1)
    WeightLoaded(0) ──▶ val_at_start ──▶ ValidationLoop.request(0)
"""

from __future__ import annotations

import logging

import grpc

from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import replay_pb2, types_pb2
from services.controller.evaluation import ValidationLoop

log = logging.getLogger("flywheel.controller.reporting")


class Reporting:
    def __init__(self, cfg: FlywheelConfig, tracker, validation: ValidationLoop | None, replay=None) -> None:
        self.cfg = cfg
        self.tracker = tracker
        self.validation = validation
        self.replay = replay
        """ReplayService stub, for train/buffer_size; None leaves the metric out."""

    async def on_step(self, report: types_pb2.StepReport) -> None:
        metrics = dict(report.metrics)
        if self.replay is not None:
            try:
                stats = await self.replay.Stats(replay_pb2.StatsRequest(), timeout=5)
                metrics["train/buffer_size"] = float(stats.size)
            except grpc.aio.AioRpcError as err:  # a metric is not worth failing the step report for
                log.warning("replay Stats failed: %s", err.code().name)
        self.tracker.log(metrics, report.step + 1)
        if self.validation is not None and self.cfg.grpo.validation_due(report.step + 1, report.final):
            await self.validation.request(report.step + 1)

    async def on_loaded(self, version: int) -> None:
        if version == 0 and self.validation is not None and self.cfg.grpo.validation_due(0, final=False):
            await self.validation.request(0)

    async def close(self) -> None:
        if self.validation is not None:
            await self.validation.drain()
        self.tracker.close()

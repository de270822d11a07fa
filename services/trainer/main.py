"""The trainer loop: for each step s, Sample(s) from replay, one GRPO step, publish weights s + 1.

    replay ──Sample(s)──▶ advantages ─▶ clipped PG loss ─▶ optimizer step ─▶ WeightSender.sync(s + 1) ─▶ rollout
                                                                           └▶ StepReport (NATS) + metrics.jsonl

Version 0 (the initial weights) is pushed before the first step, so rollout never samples
from weights the trainer does not have. Sync membership is the set of rollout workers whose
heartbeat is recent; a worker that misses a sync is dropped from it and joins the next.
Only rank 0 talks to the network; other data-parallel ranks get the batch by broadcast.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from prometheus_client import Gauge

from services.common.bus import Bus
from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc, trainer_pb2, trainer_pb2_grpc, types_pb2
from services.common.server import channel, in_daemon_thread, run_service
from services.common.telemetry import setup_telemetry
from services.common.weights import WeightSender
from services.trainer.algorithms import compute_advantages, overlong_reward_penalty
from services.trainer.batch import TrainBatch, build_batch
from services.trainer.fsdp2 import FSDP2Policy
from services.trainer.step_metrics import step_metrics

log = logging.getLogger("flywheel.trainer")
STEP_METRIC = Gauge("flywheel_trainer_step_metric", "Last value of each per-step metric (reward, KL, clip "
                    "fraction, IS ratio, timings)", ["name"])
LIVE_S = 5.0
POLL_S = 0.01


class Trainer:
    def __init__(self, cfg: FlywheelConfig, policy: FSDP2Policy, bus: Bus, sender: WeightSender) -> None:
        self.cfg = cfg
        self.policy = policy
        self.bus = bus
        self.sender = sender
        self.replay = replay_pb2_grpc.ReplayServiceStub(channel(cfg.addresses.replay))
        self.workers: dict[str, float] = {}
        self.version = 0
        self.last_sync = None
        self.metrics_path = Path(cfg.run.run_dir or ".") / "metrics.jsonl"

    def members(self) -> list[str]:
        now = time.monotonic()
        return sorted(w for w, seen in self.workers.items() if now - seen < LIVE_S)

    async def _on_heartbeat(self, msg) -> None:
        self.workers[types_pb2.RolloutHeartbeat.FromString(msg.data).worker_id] = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.nc.subscribe(self.bus.subjects.heartbeat, cb=self._on_heartbeat)
        try:
            while not self.members() and not stop.is_set():
                await asyncio.sleep(0.1)  # nothing to push version 0 to yet
            await self._sync(0)
            t_prev = time.perf_counter()
            for step in range(self.cfg.grpo.max_num_steps):
                if stop.is_set():
                    return
                report = await self._step(step, stop)
                if report is None:
                    return
                report["timing/train/total_step_time"] = time.perf_counter() - t_prev
                t_prev = time.perf_counter()
                await self._report(step, report)
        finally:
            await sub.unsubscribe()

    async def _sample(self, step: int, stop: asyncio.Event) -> tuple[replay_pb2.SampleResponse, float, float]:
        g = self.cfg.grpo
        request = replay_pb2.SampleRequest(step=step, prompts_per_step=g.num_prompts_per_step,
                                           max_staleness=g.max_staleness)
        t0 = time.perf_counter()
        while not stop.is_set():
            t_call = time.perf_counter()
            response = await self.replay.Sample(request, timeout=30, wait_for_ready=True)
            if response.ready:
                return response, t_call - t0, time.perf_counter() - t_call
            await asyncio.sleep(POLL_S)
        return None, 0.0, 0.0

    async def _step(self, step: int, stop: asyncio.Event) -> dict[str, float] | None:
        response, waited, rpc_s = await self._sample(step, stop)
        if response is None:
            return None
        t0 = time.perf_counter()
        batch = build_batch(response.groups, self.policy.tokenizer.pad_token_id,
                            overlong_filtering=self.cfg.grpo.overlong_filtering)
        metrics = await in_daemon_thread(self._train, batch)
        train_s = time.perf_counter() - t0
        sync_s = await self._sync(step + 1)
        metrics |= step_metrics(step, batch, response.groups)
        metrics.update({"timing/train/replay_wait": waited, "timing/train/replay": rpc_s,
                        "timing/train/policy_training": train_s, "timing/train/weight_sync": sync_s})
        return metrics

    def _train(self, batch: TrainBatch) -> dict[str, float]:
        g = self.cfg.grpo
        valid = batch.sample_mask > 0
        rewards = batch.rewards
        if g.reward_shaping.enabled:  # DAPO overlong penalty on the generated length
            rewards = rewards + overlong_reward_penalty(batch.token_mask.sum(dim=1), g.reward_shaping)
        advantages, adv_metrics = compute_advantages(
            rewards, batch.prompt_ids, valid, use_leave_one_out_baseline=g.use_leave_one_out_baseline,
            normalize_rewards=g.normalize_rewards, advantage_clip_low=g.advantage_clip_low,
            advantage_clip_high=g.advantage_clip_high)
        metrics = self.policy.train_step(batch, advantages)
        return {f"train/{k}": v for k, v in (metrics | adv_metrics).items()}

    async def _sync(self, version: int) -> float:
        members = self.members()
        state = self.policy.full_state_dict()
        result = await in_daemon_thread(self.sender.sync, version, members, state,
                                         timeout_s=self.cfg.weight_sync.timeout_s)
        self.version, self.last_sync = version, result
        if result.members_dropped:
            log.warning("sync v%d dropped %s", version, result.members_dropped)
            for w in result.members_dropped:
                self.workers.pop(w, None)  # back in at its next heartbeat
        return result.seconds

    async def _report(self, step: int, metrics: dict[str, float]) -> None:
        final = step + 1 == self.cfg.grpo.max_num_steps
        for name, value in metrics.items():
            STEP_METRIC.labels(name).set(value)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        await self.bus.emit(self.bus.subjects.train_step, types_pb2.StepReport(step=step, metrics=metrics,
                                                                                final=final))


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    async def Status(self, request, context):
        last = self.t.last_sync
        return trainer_pb2.TrainerServiceStatusResponse(
            version=self.t.version, weight_members=last.members_ok if last else [],
            last_sync_seconds=last.seconds if last else 0.0)


async def serve(cfg: FlywheelConfig) -> None:
    import os

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    setup_telemetry("trainer", cfg.run.name, cfg.telemetry)
    policy = FSDP2Policy(cfg)
    if policy.rank != 0:
        raise NotImplementedError("multi-rank trainer: only rank 0 is wired to replay in this version")
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="trainer")
    loop = asyncio.get_running_loop()

    def publish(announcement) -> None:  # called from the sync thread, once per epoch
        msg = types_pb2.WeightAnnouncement(**announcement.fields())
        asyncio.run_coroutine_threadsafe(bus.publish(bus.subjects.weights_announce, msg), loop).result(10)

    w = cfg.weight_sync
    sender = WeightSender(backend=w.backend, host=cfg.addresses.host, port=w.store_port,
                          bucket_bytes=w.bucket_size_mb << 20, publish=publish)
    trainer = Trainer(cfg, policy, bus, sender)
    try:
        await run_service("trainer", cfg.addresses.trainer,
                          lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
                              TrainerServicer(trainer), server), trainer.run)
    finally:
        sender.close()
        await bus.close()
        if dist.is_initialized():
            dist.destroy_process_group()

"""Rollout worker: work queue in, trajectory groups out, weights from the trainer.

    NATS work queue ──PromptGroup──▶ EpisodeRunner (engine + environment Step) ──TrajectoryGroup──▶ NATS stream
    NATS announce ──WeightAnnouncement──▶ WeightReceiver (gloo/nccl/nixl/fs) ──WeightLoaded──▶ NATS

A group is acked only after its TrajectoryGroup is stored by JetStream, so a killed worker's
groups are redelivered (after ack_wait) to another worker. A worker whose loaded version is
too old for a group's target step (target - version > max_staleness) hands it back (nak)
instead of producing a group that replay would have to drop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from nats.js.api import ConsumerConfig, DeliverPolicy
from opentelemetry import trace

from services.common.bus import Bus
from services.common.config import FlywheelConfig
from services.common.errors import require
from services.common.pb.flywheel.v1 import (environment_pb2_grpc, rollout_pb2, rollout_pb2_grpc, types_pb2)
from services.common.server import channel, run_service
from services.common.telemetry import extract_context, setup_telemetry
from services.rollout.engine import Engine, Sampling, make_engine
from services.rollout.episodes import EpisodeRunner, prompt_token_ids

log = logging.getLogger("flywheel.rollout")
ACK_WAIT_S = 30.0
HEARTBEAT_S = 1.0


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generate for evaluation: the loaded weights, no environment."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    async def Generate(self, request, context):
        require(len(request.messages) > 0, "messages must not be empty")
        require(1 <= request.n <= 64, f"n must be in 1..64, got {request.n}")
        w = self.worker
        ids = prompt_token_ids(w.engine.tokenizer, [{"role": m.role, "content": m.content} for m in request.messages])
        sampling = Sampling.resolve(w.cfg.policy.generation, request.sampling)
        outs = await asyncio.to_thread(w.engine.generate, [ids] * request.n, sampling)
        return rollout_pb2.GenerateResponse(completions=[types_pb2.Completion(
            token_ids=o.token_ids, generated_mask=[True] * len(o.token_ids), generation_logprobs=o.logprobs,
            version_start=w.version, version_end=w.version, text=o.text, truncated=o.truncated) for o in outs])


class RolloutWorker:
    def __init__(self, cfg: FlywheelConfig, engine: Engine, bus: Bus) -> None:
        self.cfg = cfg
        self.engine = engine
        self.bus = bus
        self.worker_id = f"rollout-{socket.gethostname()}-{os.getpid()}"
        self.version = -1  # nothing loaded: the first sync brings version 0
        self.in_flight = 0
        self.tracer = trace.get_tracer("flywheel.rollout")
        self.env = environment_pb2_grpc.EnvironmentServiceStub(channel(cfg.addresses.environment))
        self.runner = EpisodeRunner(engine, self.env, default_sampling=cfg.policy.generation,
                                    max_seq_len=cfg.policy.max_total_sequence_length)
        self._announcements: asyncio.Queue = asyncio.Queue()

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(c) for c in (self._heartbeats(stop), self._weights(stop), self._work(stop))]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.bus.emit(self.bus.subjects.heartbeat, types_pb2.RolloutHeartbeat(
                worker_id=self.worker_id, loaded_version=self.version, in_flight=self.in_flight,
                host=self.cfg.addresses.host))
            await asyncio.sleep(HEARTBEAT_S)

    async def _weights(self, stop: asyncio.Event) -> None:
        from services.common.weights import WeightReceiver

        receiver = WeightReceiver(self.worker_id, self.cfg.weight_sync.backend, host=self.cfg.addresses.host)

        async def on_announce(msg):
            await self._announcements.put(types_pb2.WeightAnnouncement.FromString(msg.data))

        sub = await self.bus.js.subscribe(self.bus.subjects.weights_announce, cb=on_announce, ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        buffers = self.engine.weight_buffers()
        try:
            while not stop.is_set():
                ann = await self._announcements.get()
                if self.worker_id not in ann.members or ann.version <= self.version:
                    continue  # not in this epoch: the trainer adds us at its next sync
                try:
                    with self.tracer.start_as_current_span("weights.receive", attributes={"version": ann.version}):
                        digest = await asyncio.to_thread(self._receive, receiver, ann, buffers)
                except Exception as err:  # a failed epoch is retried by the trainer or joined at the next
                    log.warning("weight sync epoch %d failed: %s", ann.epoch, err)
                    continue
                self.version = ann.version
                await self.bus.emit(self.bus.subjects.weights_loaded, types_pb2.WeightLoaded(
                    worker_id=self.worker_id, version=ann.version, checksum=digest))
        finally:
            await sub.unsubscribe()
            receiver.close()

    def _receive(self, receiver, ann, buffers) -> str:
        with self.engine.lock:  # between generate calls: no request sees half-loaded weights
            return receiver.receive(ann, buffers, timeout_s=self.cfg.weight_sync.timeout_s)

    async def _work(self, stop: asyncio.Event) -> None:
        s = self.bus.subjects
        sub = await self.bus.js.pull_subscribe(s.work, durable="rollout", stream=s.stream("work"),
                                               config=ConsumerConfig(ack_wait=ACK_WAIT_S, max_deliver=-1))
        while not stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (asyncio.TimeoutError, TimeoutError):
                continue
            for msg in msgs:
                await self._handle(msg)

    async def _handle(self, msg) -> None:
        group = types_pb2.PromptGroup.FromString(msg.data)
        if group.target_step - self.version > self.cfg.grpo.max_staleness:
            await msg.nak(delay=0.2)  # weights too old for this step: wait for the sync, or let a fresher worker take it
            return
        self.in_flight += 1
        keepalive = asyncio.create_task(self._keep_alive(msg))
        try:
            with self.tracer.start_as_current_span("rollout.group", context=extract_context(msg.headers),
                                                   attributes={"group_id": group.group_id,
                                                               "target_step": group.target_step}) as span:
                traj = await self.runner.run(group, self.worker_id, lambda: self.version)
                span.set_attribute("version_start", traj.version_start)
                span.set_attribute("generation_seconds", traj.generation_seconds)
                await self.bus.publish(self.bus.subjects.trajectories, traj, msg_id=traj.group_id)
            await msg.ack()
        except Exception:
            log.exception("group %s failed; handing it back", group.group_id)
            await msg.nak(delay=1.0)
        finally:
            keepalive.cancel()
            self.in_flight -= 1

    @staticmethod
    async def _keep_alive(msg) -> None:
        while True:  # long generations must not look like a dead worker
            await asyncio.sleep(ACK_WAIT_S / 3)
            await msg.in_progress()


async def serve(cfg: FlywheelConfig) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    setup_telemetry("rollout", cfg.run.name, cfg.telemetry)
    t0 = time.perf_counter()
    engine = make_engine(cfg)
    log.info("engine ready in %.2fs", time.perf_counter() - t0)
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="rollout")
    worker = RolloutWorker(cfg, engine, bus)
    try:
        await run_service("rollout", cfg.addresses.rollout,
                          lambda server: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                              RolloutServicer(worker), server), worker.run)
    finally:
        await bus.close()

"""The controller: leases prompt groups to rollout inside the staleness window.

    environments (config + SubmitEnvironment) ──▶ weighted mix ──▶ PromptGroup ──▶ NATS work queue
    rollout heartbeats / WeightLoaded ──▶ loaded_version ─┐
    trainer StepReport ──▶ trained_step                   ├─▶ admission: lease target t while loaded >= t - k
    replay StaleGroups ──▶ lease those prompts again ─────┘

Back-pressure is the admission rule itself (admission.py): nothing is leased for a step
whose weights are more than k versions ahead of what rollout serves, so the work queue
and the replay buffer hold at most (k + 1) * prompts_per_step groups of a healthy run.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid

from opentelemetry import trace
from prometheus_client import Counter, Gauge

from services.common.bus import Bus
from services.common.config import EnvironmentSpec, FlywheelConfig
from services.common.pb.flywheel.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from services.common.server import run_service
from services.common.telemetry import setup_telemetry
from services.controller import auth
from services.controller.admission import leasable_targets
from services.controller.registry import Registry

log = logging.getLogger("flywheel.controller")
LIVE_S = 10.0
LEASED = Counter("flywheel_controller_leased_groups_total", "Prompt groups leased", ["env"])
OUTSTANDING = Gauge("flywheel_controller_outstanding_groups", "Groups leased and not yet consumed (queue depth)")
LOADED = Gauge("flywheel_controller_loaded_version", "Newest policy version served by a live rollout worker")


class Controller:
    def __init__(self, cfg: FlywheelConfig, bus: Bus, registry: Registry) -> None:
        self.cfg = cfg
        self.bus = bus
        self.registry = registry
        self.rng = random.Random(cfg.run.seed)
        self.tracer = trace.get_tracer("flywheel.controller")
        self.workers: dict[str, tuple[int, float]] = {}  # worker_id -> (loaded version, last seen)
        self.trained_step = -1
        self.next_target = 0
        self.leased: dict[str, types_pb2.PromptGroup] = {}  # for re-leasing stale groups
        self.releases = 0
        self.wake = asyncio.Event()

    @property
    def loaded_version(self) -> int:
        now = time.monotonic()
        live = [v for v, seen in self.workers.values() if now - seen < LIVE_S]
        return max(live, default=-1)

    async def run(self, stop: asyncio.Event) -> None:
        s = self.bus.subjects
        subs = [await self.bus.nc.subscribe(s.heartbeat, cb=self._on_heartbeat),
                await self.bus.nc.subscribe(s.weights_loaded, cb=self._on_loaded),
                await self.bus.nc.subscribe(s.train_step, cb=self._on_step),
                await self.bus.nc.subscribe(s.stale, cb=self._on_stale)]
        try:
            while not stop.is_set():
                await self._lease_window()
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            for sub in subs:
                await sub.unsubscribe()

    async def _lease_window(self) -> None:
        g = self.cfg.grpo
        for target in leasable_targets(self.next_target, self.loaded_version, g.max_staleness, g.max_num_steps):
            if not self.registry.active():
                return
            for _ in range(g.num_prompts_per_step):
                await self._lease(target)
            self.next_target = target + 1
        self._forget_consumed()

    async def _lease(self, target: int, again: types_pb2.PromptGroup | None = None) -> None:
        if again is None:
            env = self.registry.choose(self.rng)
            prompt_id, row = await env.cursor.next()
            group = types_pb2.PromptGroup(
                prompt_id=f"{env.spec.name}/{prompt_id}", env_name=env.spec.name, messages=row.messages,
                metadata=row.metadata, num_generations=self.cfg.grpo.num_generations_per_prompt,
                max_turns=env.max_turns, sampling=env.sampling, reward_scale=env.reward_scale)
            env.leased += 1
        else:
            group = types_pb2.PromptGroup()
            group.CopyFrom(again)
        group.group_id = uuid.uuid4().hex
        group.target_step = target
        group.leased_at_unix_ns = time.time_ns()
        with self.tracer.start_as_current_span("controller.lease", attributes={
                "group_id": group.group_id, "target_step": target, "env": group.env_name}):
            await self.bus.publish(self.bus.subjects.work, group, msg_id=group.group_id)
        self.leased[group.group_id] = group
        LEASED.labels(group.env_name).inc()

    def _forget_consumed(self) -> None:
        horizon = self.trained_step - self.cfg.grpo.max_staleness - 1
        for gid in [gid for gid, g in self.leased.items() if g.target_step < horizon]:
            del self.leased[gid]

    async def _on_heartbeat(self, msg) -> None:
        hb = types_pb2.RolloutHeartbeat.FromString(msg.data)
        self.workers[hb.worker_id] = (hb.loaded_version, time.monotonic())
        self.wake.set()

    async def _on_loaded(self, msg) -> None:
        loaded = types_pb2.WeightLoaded.FromString(msg.data)
        self.workers[loaded.worker_id] = (loaded.version, time.monotonic())
        self.wake.set()

    async def _on_step(self, msg) -> None:
        self.trained_step = max(self.trained_step, types_pb2.StepReport.FromString(msg.data).step)
        status = self.status()
        OUTSTANDING.set(status.outstanding_groups)
        LOADED.set(status.loaded_version)
        self.wake.set()

    async def _on_stale(self, msg) -> None:
        for gid in types_pb2.StaleGroups.FromString(msg.data).group_ids:
            old = self.leased.pop(gid, None)
            if old is not None:  # lease the same prompt for the step that is waiting for data
                self.releases += 1
                await self._lease(max(self.trained_step + 1, old.target_step), again=old)

    def status(self) -> controller_pb2.StatusResponse:
        now = time.monotonic()
        consumed = (self.trained_step + 1) * self.cfg.grpo.num_prompts_per_step
        leased = sum(e.leased for e in self.registry.all()) + self.releases
        return controller_pb2.StatusResponse(
            loaded_version=self.loaded_version, trained_step=self.trained_step, next_target_step=self.next_target,
            outstanding_groups=max(0, leased - consumed), releases=self.releases,
            rollout_workers=sorted(w for w, (_, seen) in self.workers.items() if now - seen < LIVE_S),
            done=self.trained_step + 1 >= self.cfg.grpo.max_num_steps)


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    """Thin: validation lives in the registry; errors map to status codes in one place."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def SubmitEnvironment(self, request, context):
        env = await self.c.registry.submit(request.spec)
        self.c.wake.set()
        return controller_pb2.SubmitEnvironmentResponse(num_prompts=env.num_prompts)

    async def ListEnvironments(self, request, context):
        return controller_pb2.ListEnvironmentsResponse(environments=[
            controller_pb2.EnvironmentStatus(spec=e.proto, leased_groups=e.leased) for e in self.c.registry.all()])

    async def RemoveEnvironment(self, request, context):
        await self.c.registry.remove(request.name)
        return controller_pb2.RemoveEnvironmentResponse()

    async def Status(self, request, context):
        return self.c.status()


def spec_from_config(spec: EnvironmentSpec) -> controller_pb2.EnvironmentSpec:
    """The config file's environment as the SubmitEnvironment message, so both go through one validation."""
    return controller_pb2.EnvironmentSpec(
        name=spec.name, kind=spec.kind, address=spec.address, jsonl_path=spec.dataset, weight=spec.weight,
        max_turns=spec.max_turns, reward_scale=spec.reward_scale, timeout_seconds=spec.timeout_s,
        sampling=types_pb2.SamplingParams(**spec.sampling.model_dump()))


async def serve(cfg: FlywheelConfig) -> None:
    setup_telemetry("controller", cfg.run.name, cfg.telemetry)
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="controller")
    registry = Registry(cfg)
    for spec in cfg.environments:
        await registry.submit(spec_from_config(spec))
    controller = Controller(cfg, bus, registry)
    try:
        await run_service("controller", cfg.addresses.controller,
                          lambda server: controller_pb2_grpc.add_ControllerServiceServicer_to_server(
                              ControllerServicer(controller), server), controller.run,
                          interceptors=auth.interceptors(cfg.controller.auth_token))
    finally:
        await registry.close()
        await bus.close()

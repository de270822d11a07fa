"""The controller: leases prompt groups to rollout inside the staleness window.

    environments (config + SubmitEnvironment) ──▶ weighted mix ──▶ PromptGroup ──▶ NATS work queue
    rollout heartbeats / WeightLoaded ──▶ loaded_version ─┐
    trainer StepReport ──▶ trained_step                   ├─▶ admission: lease target t while loaded >= t - k
    replay StaleGroups ──▶ lease those prompts again ─────┘
    rollout PoisonedGroup ──▶ count; lease new prompts, or stop the run past rollout.max_poisoned_groups (poison.py)

Back-pressure is the admission rule itself (admission.py): nothing is leased for a step
whose weights are more than k versions ahead of what rollout serves, so the work queue
and the replay buffer hold at most (k + 1) * prompts_per_step groups of a healthy run.

Leasing goes in units (a window's targets, or one event's replacement), one at a time (a lock), each:

    save the intent (RunState.doing) ──▶ draw and publish its groups ──▶ save its leases, then the run state

A controller killed inside a unit redoes its intent first thing when it restarts (resume), from the run state
saved with it: the same cursor offsets and the same keys draw the same prompts under the same group ids (each a
function of the run's lease seed and of what the lease is for: step t's i-th prompt, the replacement of group g),
so JetStream drops the copies already published, if they come within the work stream's duplicate window (an
hour: bus.WORK_DEDUP_WINDOW_S); after it, rollout generates them again and replay drops them by id
(docs/data.md). An event is acked after its unit, so a killed one is delivered again and finds its replacement
leased. A unit that fails half done (a publish that fails for good) stops the controller, so its
successor redoes it. tests/integration/test_controller_kills.py kills a controller at each of these points.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid

from opentelemetry import trace
from prometheus_client import Counter, Gauge

from services.common.bus import Bus
from services.common.config import EnvironmentSpec, FlywheelConfig
from services.common.errors import AlreadyExists, InvalidArgument, RunFailed, Unavailable
from services.common.logs import RateLimitedLog
from services.common.pb.flywheel.v1 import (controller_pb2, controller_pb2_grpc, replay_pb2_grpc,
                                            rollout_pb2_grpc, types_pb2)
from services.common.server import channel, run_service
from services.common.structs import to_struct
from services.common.telemetry import setup_telemetry
from services.controller import auth
from services.controller.admission import leasable_targets
from services.common.data import LoadedData, load_data
from services.controller.datasets import EpochCursor, Exhausted
from services.controller.evaluation import ValidationLoop, Validator, generated_prompts, validation_prompts
from services.controller.offline import serve_offline
from services.controller.registry import Registry
from services.controller.replacements import Replacements
from services.controller.reporting import Reporting
from services.controller.state import RunState, StateStore
from services.controller.tracking import Tracker

log = logging.getLogger("flywheel.controller")
_warn = RateLimitedLog(log)
LIVE_S = 10.0
REGISTER_CHECK_S = 2.0
"""How often the controller checks that the environment service still knows the mix (a restart forgets it)."""
LEASED = Counter("flywheel_controller_leased_groups_total", "Prompt groups leased", ["env"])
GROUP_ID_LEN = 32
"""Hex digits of a group id (a sha256 prefix, _group_id)."""
OUTSTANDING = Gauge("flywheel_controller_outstanding_groups", "Groups leased and not yet consumed (queue depth)")
LOADED = Gauge("flywheel_controller_loaded_version", "Newest policy version served by a live rollout worker")


class Controller(Replacements):
    def __init__(self, cfg: FlywheelConfig, bus: Bus, registry: Registry, reporting: Reporting | None = None,
                 state: StateStore | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.registry = registry
        self.reporting = reporting
        self.state = state
        """Where the lease position is saved after every window (state.py); None keeps it in memory only."""
        self.tracer = trace.get_tracer("flywheel.controller")
        self.workers: dict[str, tuple[int, float]] = {}  # worker_id -> (loaded version, last seen)
        self.trained_step = -1
        self.next_target = 0
        self.leased: dict[str, types_pb2.PromptGroup] = {}  # for re-leasing stale groups
        self.lease_seed = uuid.uuid4().hex
        """Makes group ids unique to this run; saved with its state, so a restarted controller keeps it."""
        self.releases = 0
        self.refills: dict[int, int] = {}  # target step -> prompts leased to replace filtered groups
        self.poisoned = 0  # groups rollout gave up on (poison.py)
        self.fatal = ""  # set when the run cannot go on (NeMo RL raises there too)
        self.wake = asyncio.Event()
        self.broken: Exception | None = None
        """What stopped a lease unit half done (a publish that failed for good): the run loop raises it, so the
        controller exits and its successor redoes the unit from the saved intent (an event handler's own error
        would only be logged, and the controller would go on with the unit's draws half made)."""
        self.leasing = asyncio.Lock()
        """Held by one lease unit (and the handler deciding it) at a time: a unit's saved cursor offsets are then
        those its first draw starts from, which a restarted controller's redo needs."""

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
                await self.bus.consume(s.stale, "controller-stale", self._on_stale),
                await self.bus.consume(s.filtered, "controller-filtered", self._on_filtered),
                await self.bus.consume(s.poisoned, "controller-poisoned", self._on_poisoned)]
        registered = asyncio.create_task(self._keep_registered())
        try:
            while not stop.is_set():
                if self.fatal:
                    raise RunFailed(self.fatal)
                if self.broken is not None:
                    raise self.broken
                async with self.leasing:
                    await self._lease_window()
                    await self._save()  # what changed outside units: forgotten leases
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
        finally:
            registered.cancel()
            for sub in subs:
                await sub.unsubscribe()

    async def _keep_registered(self) -> None:
        while True:
            await asyncio.sleep(REGISTER_CHECK_S)
            try:
                lost = await self.registry.register_lost()
            except (Unavailable, InvalidArgument) as err:  # down or restarting: the next check registers them
                log.warning("environment service check failed: %s", err)
                continue
            if lost:
                log.warning("the environment service had lost %s (restarted?); registered again", lost)

    async def _lease_window(self) -> None:
        g = self.cfg.grpo
        targets = leasable_targets(self.next_target, self.loaded_version, g.max_staleness, g.max_num_steps)
        if targets and self.registry.active():
            await self._unit({"targets": [targets.start, targets.stop]})
        self._forget_consumed()

    async def _unit(self, doing: dict) -> None:
        """One lease unit (the module docstring): its intent saved, done, its outcome saved. Lock held."""
        if self.broken is not None:  # an event's unit after a half-done one: unacked, the successor gets it
            raise self.broken
        if self.state is not None:
            await self.state.save(self.snapshot(doing))
        try:
            await self._do(doing)
            await self._save()
        except Exception as err:
            self.broken = err
            self.wake.set()
            raise

    async def _do(self, doing: dict) -> None:
        """A window's targets ({"targets": [first, stop]}), or an event's replacement ({"target", "key", "drop":
        the group it replaces, "again": lease a copy of it}), from the state of when the intent was saved."""
        if "targets" in doing:
            return await self._lease_targets(range(*doing["targets"]))
        old = self.leased.pop(doing["drop"], None)
        if doing["again"] and old is None:  # a redo after the outcome's leases were saved: the copy has its prompt
            old = self.leased.get(self._group_id(doing["key"]))
        await self._lease(doing["target"], doing["key"], again=old if doing["again"] else None)

    async def _save(self) -> None:
        """Leases first: a run state saved with them lost would leave published groups with no record."""
        if self.state is not None:
            await self.state.save_leases(self.leased)
            await self.state.save(self.snapshot())

    async def _lease_targets(self, targets: range) -> None:
        g = self.cfg.grpo
        for target in targets:
            if not self.registry.active():
                return
            groups = []
            for i in range(g.num_prompts_per_step):
                group = await self._draw(target, f"step/{target}/{i}")
                if group is None:
                    break
                groups.append(group)
            await self._publish(groups)
            if len(groups) < g.num_prompts_per_step:
                return
            self.next_target = target + 1

    def snapshot(self, doing: dict | None = None) -> RunState:
        entries = self.registry.all()
        return RunState(next_target=self.next_target, releases=self.releases, lease_seed=self.lease_seed,
                        poisoned=self.poisoned, doing=doing or {},
                        offsets={e.spec.name: e.cursor.offset for e in entries},
                        leased={e.spec.name: e.leased for e in entries})

    async def resume(self) -> None:
        """Continue the run a stopped controller was leasing, if the state store has one: same next target and
        lease seed, each cursor where it was, and the groups in flight, so the stale ones among them are leased
        again. A new run saves its state (the lease seed) before its first lease."""
        saved = await self.state.load()
        if saved is None:
            await self.state.save(self.snapshot())
            return
        self.next_target, self.releases, self.poisoned = saved.next_target, saved.releases, saved.poisoned
        self.leased = await self.state.load_leases()
        self.lease_seed = saved.lease_seed or self.lease_seed  # a state saved before lease seeds had none
        for entry in self.registry.all():
            entry.cursor.seek(saved.offsets.get(entry.spec.name, 0))
            entry.leased = saved.leased.get(entry.spec.name, 0)
        log.info("resumed the run's leases: next target step %d, cursors %s", self.next_target, saved.offsets)
        if saved.doing:  # killed inside a lease unit: finish it before anything else draws
            log.info("redoing the lease unit the previous controller was in: %s", saved.doing)
            await self._do(saved.doing)
            await self._save()

    async def _lease(self, target: int, key: str, again: types_pb2.PromptGroup | None = None) -> bool:
        """Publishes one group for `target`; False when the chosen dataset's epochs are used up."""
        group = await self._draw(target, key, again)
        if group is None:
            return False
        await self._publish([group])
        return True

    async def _draw(self, target: int, key: str, again: types_pb2.PromptGroup | None = None
                    ) -> types_pb2.PromptGroup | None:
        """The group to lease for `target` (a copy of `again`, or the next prompt of an environment of the mix);
        None when the chosen dataset's epochs are used up. `key` names what the lease is for, the same after a
        restart: the group id and the environment drawn follow from it."""
        if again is None:
            env = self.registry.choose(random.Random(f"{self.cfg.run.seed}/{key}"))
            try:
                prompt_id, row = await env.cursor.next()
            except Exhausted:
                env.proto.weight = 0  # out of the mix: grpo.max_num_epochs reached
                log.warning("%s: grpo.max_num_epochs=%d done; no more prompts from it",
                            env.spec.name, self.cfg.grpo.max_num_epochs)
                if not self.registry.active():  # the trainer would wait for ever: stop the run, saying why
                    self.fatal = (f"step {target} has no prompts left: grpo.max_num_epochs="
                                  f"{self.cfg.grpo.max_num_epochs} are used up (dynamic sampling and stale "
                                  f"re-leases take more prompts than the planned steps); raise max_num_epochs or "
                                  f"lower grpo.max_num_steps")
                return None
            group = types_pb2.PromptGroup(
                prompt_id=f"{env.spec.name}/{prompt_id}", env_name=env.spec.name, messages=row.messages,
                tools=row.tools, metadata=row.metadata, num_generations=self.cfg.grpo.num_generations_per_prompt,
                max_turns=env.max_turns, sampling=env.sampling, reward_scale=env.reward_scale)
            env.leased += 1
        else:
            group = types_pb2.PromptGroup()
            group.CopyFrom(again)
        group.group_id = self._group_id(key)
        group.target_step = target
        return group

    async def _publish(self, groups: list[types_pb2.PromptGroup]) -> None:
        """Publishes the groups at once, not one broker round trip after another (16 leases: 0.6 ms instead of
        2.1 on an idle machine): a rollout worker finds a step's groups in the queue together and its engine
        batches them, instead of starting the first group alone. A failed publish raises; the controller then
        stops, and its successor leases the saved window again (the module docstring)."""

        async def publish(group: types_pb2.PromptGroup) -> None:
            group.leased_at_unix_ns = time.time_ns()
            with self.tracer.start_as_current_span("controller.lease", attributes={  # the group's trace starts here
                    "flywheel.group_id": group.group_id, "flywheel.target_step": group.target_step,
                    "flywheel.env": group.env_name}):
                await self.bus.publish(self.bus.subjects.work, group, msg_id=group.group_id)

        await asyncio.gather(*map(publish, groups))
        for group in groups:
            self.leased[group.group_id] = group
            LEASED.labels(group.env_name).inc()

    def _group_id(self, key: str) -> str:
        return hashlib.sha256(f"{self.lease_seed}/{key}".encode()).hexdigest()[:GROUP_ID_LEN]

    @staticmethod
    def _is_group_id(text: str) -> bool:
        """Whether `text` has _group_id's form. An event naming anything else names no lease of any controller:
        it is dropped before it reaches a lease unit, whose saved intent would carry it (a near-max_payload id
        made that save fail, and the event came back for ever)."""
        return len(text) == GROUP_ID_LEN and all(c in "0123456789abcdef" for c in text)

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
        if self.reporting is not None:
            await self.reporting.on_loaded(loaded.version)

    async def _on_step(self, msg) -> None:
        report = types_pb2.StepReport.FromString(msg.data)
        # Not this run's trainer's (as replay, reports.py): a step of 2^63 - 1 overflowed every later lease.
        if not 0 <= report.step < self.cfg.grpo.max_num_steps:
            _warn.warning("step", "ignored a step report for step %d", report.step)
            return
        self.trained_step = max(self.trained_step, report.step)
        status = self.status()
        OUTSTANDING.set(status.outstanding_groups)
        LOADED.set(status.loaded_version)
        self.wake.set()
        if self.reporting is not None:
            await self.reporting.on_step(report)

    def status(self) -> controller_pb2.StatusResponse:
        now = time.monotonic()
        consumed = (self.trained_step + 1) * self.cfg.grpo.num_prompts_per_step
        leased = sum(e.leased for e in self.registry.all()) + self.releases
        return controller_pb2.StatusResponse(
            loaded_version=self.loaded_version, trained_step=self.trained_step, next_target_step=self.next_target,
            outstanding_groups=max(0, leased - consumed - self.poisoned), releases=self.releases,
            rollout_workers=sorted(w for w, (_, seen) in self.workers.items() if now - seen < LIVE_S),
            done=self.trained_step + 1 >= self.cfg.grpo.max_num_steps)


class ControllerServicer(controller_pb2_grpc.ControllerServiceServicer):
    """Thin: validation lives in the registry; errors map to status codes in one place."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def SubmitEnvironment(self, request, context):
        env = await self.c.registry.submit(request.spec)
        if self.c.state is not None:
            await self.c.state.save_submitted(request.spec)
        self.c.wake.set()
        return controller_pb2.SubmitEnvironmentResponse(num_prompts=env.num_prompts)

    async def ListEnvironments(self, request, context):
        return controller_pb2.ListEnvironmentsResponse(environments=[
            controller_pb2.EnvironmentStatus(spec=e.proto, leased_groups=e.leased) for e in self.c.registry.all()])

    async def RemoveEnvironment(self, request, context):
        await self.c.registry.remove(request.name)
        if self.c.state is not None:
            await self.c.state.forget_submitted(request.name)
        return controller_pb2.RemoveEnvironmentResponse()

    async def Status(self, request, context):
        return self.c.status()


def spec_from_config(spec: EnvironmentSpec) -> controller_pb2.EnvironmentSpec:
    """The config file's environment as the SubmitEnvironment message, so both go through one validation."""
    return controller_pb2.EnvironmentSpec(
        name=spec.name, kind=spec.kind, address=spec.address, jsonl_path=spec.dataset, weight=spec.weight,
        max_turns=spec.max_turns, reward_scale=spec.reward_scale, timeout_seconds=spec.timeout_s,
        sampling=types_pb2.SamplingParams(**spec.sampling.model_dump()),
        agent=to_struct(spec.agent) if spec.agent else None)


async def submit_data(cfg: FlywheelConfig, registry: Registry, data: LoadedData) -> None:
    """Each data.train dataset joins the mix under its env_name, its rows in NeMo RL's epoch order, weighted by
    its size: NeMo RL concatenates a list of train datasets into one, so each row is equally likely to come next."""
    g = cfg.grpo
    for i, prompts in enumerate(data.train):
        name = prompts.env_name if len(data.train) == 1 else f"{prompts.env_name}-{i}"
        cursor = EpochCursor(prompts.rows, prompts_per_step=g.num_prompts_per_step, epochs=g.max_num_epochs,
                             seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        await registry.submit(controller_pb2.EnvironmentSpec(name=name, kind=prompts.env_name,
                                                             weight=float(len(prompts.rows))), cursor)


async def resubmit(registry: Registry, state: StateStore) -> None:
    """The environments clients submitted before a restart join the mix again (their cursors are restored with
    the rest of the run state). One that no longer validates (e.g. its remote is gone) is dropped, loudly; an
    environment service that does not answer raises (the controller exits, and its supervisor retries)."""
    for spec in await state.load_submitted():
        try:
            await registry.submit(spec)
        except (InvalidArgument, AlreadyExists) as err:
            log.error("the submitted environment %r cannot rejoin the mix and is dropped: %s", spec.name, err)
            await state.forget_submitted(spec.name)


async def _validation(cfg: FlywheelConfig, data: LoadedData, registry: Registry, tracker: Tracker,
                      state: StateStore) -> ValidationLoop | None:
    """Validation over data.validation (and split_validation_size hold-outs), else over prompts the config's
    environments generate (grpo.max_val_samples in all, shared among them); None when there is none."""
    prompts = validation_prompts(cfg, data.validation)
    if not prompts and cfg.grpo.validates:
        prompts = await generated_prompts(cfg, registry)
    if not prompts:
        return None
    rollout = rollout_pb2_grpc.RolloutServiceStub(channel(cfg.addresses.rollout, security=cfg.security))
    return ValidationLoop(cfg, Validator(prompts, rollout, n=cfg.grpo.val_num_generations_per_prompt), tracker, state)


async def serve(cfg: FlywheelConfig) -> None:
    setup_telemetry("controller", cfg.run.name, cfg.telemetry)
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="controller")
    if cfg.offline is not None:  # SFT, DPO, RM: dataset rows to the trajectory stream, no environments
        try:
            return await serve_offline(cfg, bus)
        finally:
            await bus.close()
    registry = Registry(cfg)
    data = load_data(cfg)
    for spec in cfg.environments:
        await registry.submit(spec_from_config(spec))
    await submit_data(cfg, registry, data)
    state = await StateStore.open(bus.js, cfg.run.name)
    await resubmit(registry, state)
    tracker = Tracker(cfg)
    reporting = Reporting(cfg, tracker, await _validation(cfg, data, registry, tracker, state),
                          replay_pb2_grpc.ReplayServiceStub(channel(cfg.addresses.replay, security=cfg.security)))
    controller = Controller(cfg, bus, registry, reporting, state)
    await controller.resume()
    if reporting.validation is not None:
        await reporting.validation.resume()
    try:
        await run_service("controller", cfg.addresses.controller,
                          lambda server: controller_pb2_grpc.add_ControllerServiceServicer_to_server(
                              ControllerServicer(controller), server), controller.run,
                          interceptors=auth.interceptors(cfg.controller.auth_token),
                          security=cfg.security, public=auth.PUBLIC)
    finally:
        await reporting.close()
        await registry.close()
        await bus.close()

"""The environment mix: validated specs, their datasets, and weighted choice.

A submitted environment is checked (`validate`), registered with the environment service
under its name (a built-in kind, or a remote address the environment service must reach),
its dataset is loaded and checked non-empty, and from then on `choose` may draw it: it
joins the running mix at the next lease. Every rejection is a typed error with a message
that names the environment and the field, so the client sees a clear INVALID_ARGUMENT
(ALREADY_EXISTS for a name in use) and the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import re
from dataclasses import dataclass

import grpc

from services.common.config import AGENT, FlywheelConfig
from services.common.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable,
                                    require)
from services.common.pb.flywheel.v1 import controller_pb2, environment_pb2, environment_pb2_grpc, types_pb2
from services.common.server import channel
from services.common.work import check_episodes, check_sampling
from services.common.data import DataError, load_rows
from services.controller.datasets import Cursor, EpochCursor

NAME = re.compile(r"^[a-z0-9_-]{1,64}$")
ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
CHUNK = 256
"""Generated prompts fetched from the environment service per call."""


@dataclass(kw_only=True, slots=True)
class Entry:
    proto: controller_pb2.EnvironmentSpec
    """The spec as submitted, minus inline rows (they live in the cursor)."""
    cursor: Cursor
    num_prompts: int
    """Rows in the dataset; 0 for an endless generated stream."""
    default_max_turns: int = 1
    """grpo.max_rollout_turns, used when the spec leaves max_turns at 0."""
    leased: int = 0

    @property
    def spec(self) -> controller_pb2.EnvironmentSpec:
        return self.proto

    @property
    def max_turns(self) -> int:
        return self.proto.max_turns or self.default_max_turns

    @property
    def sampling(self) -> types_pb2.SamplingParams:
        return self.proto.sampling

    @property
    def reward_scale(self) -> float:
        return self.proto.reward_scale or 1.0


class Registry:
    def __init__(self, cfg: FlywheelConfig) -> None:
        self.cfg = cfg
        self._channel = channel(cfg.addresses.environment, security=cfg.security)
        self.env = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        self.agents = environment_pb2_grpc.AgentServiceStub(self._channel)
        self.entries: dict[str, Entry] = {}
        self._pending: set[str] = set()  # names being submitted: a concurrent duplicate is refused at once

    def all(self) -> list[Entry]:
        return list(self.entries.values())

    def active(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.proto.weight > 0]

    def choose(self, rng: random.Random) -> Entry:
        active = self.active()
        return rng.choices(active, weights=[e.proto.weight for e in active])[0]

    async def submit(self, spec: controller_pb2.EnvironmentSpec, cursor: EpochCursor | None = None) -> Entry:
        """`cursor`: data.train rows the controller read itself (the spec then names no dataset)."""
        validate(spec)
        limit = self.cfg.rollout.step_timeout_s
        require(spec.timeout_seconds < limit,
                f"{spec.name}: timeout_seconds {spec.timeout_seconds:g} must be below rollout.step_timeout_s "
                f"({limit:g}), the deadline of rollout's Step calls, which would cut it first")
        require(spec.kind != AGENT or self.cfg.policy.generation.endpoint.enabled,
                f"{spec.name}: an agent environment needs the rollout workers' endpoint, and this run serves none: "
                "start the run with policy.generation.endpoint.enabled=true (or an agent in `environments`)")
        if spec.name in self.entries or spec.name in self._pending:
            raise AlreadyExists(f"environment {spec.name!r} is already in the mix; remove it first "
                                f"(flywheel env remove {spec.name}) or pick another name")
        self._pending.add(spec.name)
        try:
            return await self._add(spec, cursor)
        finally:
            self._pending.discard(spec.name)

    async def register(self, spec: controller_pb2.EnvironmentSpec) -> None:
        """Makes `spec` known to the environment service without adding it to the mix (no dataset read, nothing
        leased from it): eval and collect score prompts of their own with it."""
        validate(spec)
        await self._register(spec)

    async def _add(self, spec: controller_pb2.EnvironmentSpec, data: EpochCursor | None) -> Entry:
        await self._register(spec)
        try:
            cursor, count = (data, len(data.rows)) if data is not None else await self._dataset(spec)
        except BaseException:
            with contextlib.suppress(grpc.aio.AioRpcError):  # the dataset error is the one to report
                await self.env.Unregister(environment_pb2.UnregisterRequest(name=spec.name), timeout=15)
            raise
        stored = controller_pb2.EnvironmentSpec()
        stored.CopyFrom(spec)
        stored.ClearField("rows")
        entry = Entry(proto=stored, cursor=cursor, num_prompts=count,
                      default_max_turns=self.cfg.grpo.max_rollout_turns)
        self.entries[spec.name] = entry
        return entry

    async def generated(self, name: str, count: int, seed: int) -> list[types_pb2.PromptGroup]:
        """`count` prompts environment `name` generates from `seed`, each with the entry's max_turns and sampling."""
        entry = self.entries[name]
        rows = []
        for offset in range(0, count, CHUNK):  # as a cursor reads: a call answers at most 10,000 rows
            rows += await self._prompts(name, min(CHUNK, count - offset), seed, offset)
        return [types_pb2.PromptGroup(env_name=name, messages=row.messages, tools=row.tools, metadata=row.metadata,
                                      max_turns=entry.max_turns, sampling=entry.sampling) for row in rows]

    async def _prompts(self, name: str, count: int, seed: int, offset: int) -> list[types_pb2.DatasetRow]:
        """Rows `offset`.. of the stream environment `name` generates from `seed`."""
        response = await self._call(name, self.env.Prompts(environment_pb2.PromptsRequest(
            env_name=name, count=count, seed=seed, offset=offset), timeout=30, wait_for_ready=True))
        return list(response.rows)

    async def register_lost(self) -> list[str]:
        """Registers again each environment of the mix the environment service does not list (it keeps
        registrations in memory, so a restarted one has forgotten them); returns their names."""
        listed = await self._call("*", self.env.List(environment_pb2.ListRequest(), timeout=5))
        lost = [e.spec for e in self.all() if e.spec.name not in listed.registered]
        for spec in lost:
            if spec.name in self.entries:  # not removed meanwhile
                await self._register(spec)
        return [spec.name for spec in lost]

    async def _register(self, spec: controller_pb2.EnvironmentSpec) -> None:
        if spec.kind == AGENT:  # the environment service's AgentService runs its episodes
            await self._call(spec.name, self.agents.RegisterAgent(environment_pb2.RegisterAgentRequest(
                name=spec.name, agent=spec.agent, timeout_seconds=spec.timeout_seconds), timeout=30,
                wait_for_ready=True))
            return
        await self._call(spec.name, self.env.Register(environment_pb2.RegisterRequest(
            name=spec.name, kind=spec.kind, address=spec.address, timeout_seconds=spec.timeout_seconds),
            timeout=30, wait_for_ready=True))

    async def remove(self, name: str) -> None:
        """Stops leasing from `name` now; the environment service keeps serving groups already leased."""
        if name not in self.entries:
            known = ", ".join(sorted(self.entries)) or "none"
            raise NotFound(f"no environment named {name!r} in the mix (environments: {known})")
        if self.entries[name].proto.weight > 0 and len(self.active()) == 1:
            raise FailedPrecondition(f"{name!r} is the only environment the run draws prompts from; removing it "
                                     "would starve the run: submit another one first")
        del self.entries[name]
        await self._call(name, self.env.Unregister(environment_pb2.UnregisterRequest(name=name), timeout=15))

    async def _dataset(self, spec: controller_pb2.EnvironmentSpec) -> tuple[Cursor, int]:
        if spec.rows:
            return Cursor(rows=list(spec.rows)), len(spec.rows)
        if spec.jsonl_path:
            try:
                # In a thread: a path that names a hub dataset waits on the network (~25 s of retries offline),
                # and the controller's leases and rpcs must not wait with it.
                rows = await asyncio.to_thread(load_rows, spec.jsonl_path)
            except DataError as err:
                raise InvalidArgument(f"environment {spec.name!r}: {err}") from None
            return Cursor(rows=rows), len(rows)

        async def fetch(offset: int, count: int):
            return await self._prompts(spec.name, count, self.cfg.run.seed, offset)

        try:
            first = await fetch(0, CHUNK)
        except InvalidArgument:
            first = []  # UNIMPLEMENTED or refused: the environment generates no prompts
        if not first:
            raise InvalidArgument(f"environment {spec.name!r} has an empty dataset: give rows or jsonl_path "
                                  f"(it generates no prompts)")
        return Cursor(fetch=fetch, chunk=CHUNK, prefetched=first), 0

    async def _call(self, name: str, call):
        """Awaits an environment-service rpc; its refusals become typed errors naming `name`."""
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.UNIMPLEMENTED):
                raise InvalidArgument(f"environment {name!r}: {err.details()}") from None
            raise Unavailable(f"environment service at {self.cfg.addresses.environment} failed for {name!r}: "
                              f"{err.code().name}: {err.details()}") from None

    async def close(self) -> None:
        await self._channel.close()


def validate(spec: controller_pb2.EnvironmentSpec) -> None:
    """Raises InvalidArgument naming the first bad field of `spec` (pure: no network)."""
    require(bool(NAME.match(spec.name)), f"name must match {NAME.pattern}, got {spec.name!r}")
    n = spec.name
    require(bool(spec.kind) != bool(spec.address),
            f"{n}: set exactly one of kind (a built-in) or address (host:port of a remote environment)")
    require((spec.kind == AGENT) == spec.HasField("agent"),
            f"{n}: kind {AGENT!r} needs `agent` (its spec: {{\"type\": \"program\", \"command\": [...]}}), "
            "and only it takes one")
    if spec.address:
        match = ADDRESS.match(spec.address)
        require(bool(match) and 0 < int(match.group(2)) < 65536,
                f"{n}: address must be host:port, got {spec.address!r}")
    require(math.isfinite(spec.weight) and spec.weight >= 0, f"{n}: weight must be >= 0, got {spec.weight}")
    require(not (spec.rows and spec.jsonl_path), f"{n}: set at most one of rows or jsonl_path")
    for i, row in enumerate(spec.rows):
        require(len(row.messages) > 0, f"{n}: rows[{i}] has no messages")
    check_episodes(spec.max_turns, spec.reward_scale, f"{n}: ")
    require(math.isfinite(spec.timeout_seconds) and spec.timeout_seconds >= 0,
            f"{n}: timeout_seconds must be >= 0, got {spec.timeout_seconds}")
    check_sampling(spec.sampling, f"{n}: sampling")

"""The environment mix: validated specs, their datasets, and weighted choice.

A submitted environment is registered with the environment service under its name
(a built-in kind or a remote address), its dataset is loaded and checked non-empty, and
from then on `choose` may draw it: it joins the running mix at the next lease.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import grpc

from services.common.config import FlywheelConfig
from services.common.errors import AlreadyExists, InvalidArgument, NotFound, require
from services.common.pb.flywheel.v1 import controller_pb2, environment_pb2, environment_pb2_grpc, types_pb2
from services.common.server import channel
from services.controller.datasets import Cursor, load_jsonl

NAME = re.compile(r"^[a-z0-9_-]{1,64}$")


@dataclass(kw_only=True, slots=True)
class Entry:
    proto: controller_pb2.EnvironmentSpec
    cursor: Cursor
    num_prompts: int
    """Rows in the dataset; 0 for an endless generated stream."""
    leased: int = 0

    @property
    def spec(self) -> controller_pb2.EnvironmentSpec:
        return self.proto

    @property
    def max_turns(self) -> int:
        return self.proto.max_turns or 1

    @property
    def sampling(self) -> types_pb2.SamplingParams:
        return self.proto.sampling

    @property
    def reward_scale(self) -> float:
        return self.proto.reward_scale or 1.0


class Registry:
    def __init__(self, cfg: FlywheelConfig) -> None:
        self.cfg = cfg
        self._channel = channel(cfg.addresses.environment)
        self.env = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        self.entries: dict[str, Entry] = {}

    def all(self) -> list[Entry]:
        return list(self.entries.values())

    def active(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.proto.weight > 0]

    def choose(self, rng: random.Random) -> Entry:
        active = self.active()
        return rng.choices(active, weights=[e.proto.weight for e in active])[0]

    async def submit(self, spec: controller_pb2.EnvironmentSpec) -> Entry:
        spec = _validated(spec)
        if spec.name in self.entries:
            raise AlreadyExists(f"environment {spec.name!r} already exists; remove it first")
        await self._call(self.env.Register(environment_pb2.RegisterRequest(
            name=spec.name, kind=spec.kind, address=spec.address), timeout=30, wait_for_ready=True))
        try:
            cursor, count = await self._dataset(spec)
        except Exception:
            await self.env.Unregister(environment_pb2.UnregisterRequest(name=spec.name), timeout=15)
            raise
        entry = Entry(proto=spec, cursor=cursor, num_prompts=count)
        self.entries[spec.name] = entry
        return entry

    async def remove(self, name: str) -> None:
        if name not in self.entries:
            raise NotFound(f"no environment named {name!r}")
        del self.entries[name]
        await self.env.Unregister(environment_pb2.UnregisterRequest(name=name), timeout=15)

    async def _dataset(self, spec: controller_pb2.EnvironmentSpec) -> tuple[Cursor, int]:
        if spec.rows:
            return Cursor(rows=list(spec.rows)), len(spec.rows)
        if spec.jsonl_path:
            rows = load_jsonl(spec.jsonl_path)
            return Cursor(rows=rows), len(rows)

        async def fetch(offset: int, count: int):
            response = await self._call(self.env.Prompts(environment_pb2.PromptsRequest(
                env_name=spec.name, count=count, seed=self.cfg.run.seed, offset=offset), timeout=30, wait_for_ready=True))
            return response.rows

        first = await fetch(0, 256)
        if not first:
            raise InvalidArgument(f"environment {spec.name!r} has an empty dataset: give rows or jsonl_path")
        return Cursor(fetch=fetch, chunk=256, prefetched=first), 0

    @staticmethod
    async def _call(call):
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.UNIMPLEMENTED):
                raise InvalidArgument(err.details()) from None
            raise

    async def close(self) -> None:
        await self._channel.close()


def _validated(spec: controller_pb2.EnvironmentSpec) -> controller_pb2.EnvironmentSpec:
    require(bool(NAME.match(spec.name)), f"name must match {NAME.pattern}, got {spec.name!r}")
    require(bool(spec.kind) != bool(spec.address), f"{spec.name}: set exactly one of kind or address")
    require(spec.weight >= 0, f"{spec.name}: weight must be >= 0, got {spec.weight}")
    require(not (spec.rows and spec.jsonl_path), f"{spec.name}: set at most one of rows or jsonl_path")
    require(spec.max_turns >= 0, f"{spec.name}: max_turns must be >= 0, got {spec.max_turns}")
    require(spec.reward_scale >= 0, f"{spec.name}: reward_scale must be >= 0, got {spec.reward_scale}")
    require(spec.sampling.max_new_tokens >= 0, f"{spec.name}: sampling.max_new_tokens must be >= 0")
    return spec

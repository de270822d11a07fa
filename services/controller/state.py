"""The controller's share of run state, kept in a NATS KV bucket so a restarted controller goes on.

    lease window ──▶ RunState{next_target, cursor offsets, leased counts, releases, lease seed} ──put──▶ key "controller"
                 └─▶ groups leased and not yet trained ──put / purge──▶ keys "lease.<group id>"
    SubmitEnvironment / RemoveEnvironment ──put / purge──▶ keys "env.<name>" (the spec as submitted)
    controller start ──get──▶ RunState, leases, submitted specs ──▶ same mix, same next target, each
                              dataset cursor at its offset (epoch included), stale groups still re-leasable
    a validation of version v requested ──put──▶ key "validating.<v>" ──purge──▶ once it is done (or failed)
                              done ──put──▶ key "validated.<v>" (its metrics) ──▶ the trainer ranks checkpoints by them
    controller start ──get──▶ validations requested and not done ──▶ run now (with the weights rollout has then)

Dataset cursors are one integer each (data/plan.py), so the state is small and a restarted
controller leases exactly the prompts that come next, never the epoch's first ones again, and a
group leased before the stop that goes stale after it is leased again with its prompt. The bucket
lives in JetStream's file store, next to the work queue it describes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from nats.js.errors import KeyNotFoundError

from services.common.bus import VALIDATED, open_state_bucket, read_prefixed
from services.common.pb.flywheel.v1 import controller_pb2, types_pb2

KEY = "controller"
LEASE = "lease."
SUBMITTED = "env."
VALIDATING = "validating."


@dataclass(kw_only=True, slots=True)
class RunState:
    next_target: int = 0
    """First target step not yet leased."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Environment name -> prompts its cursor has handed out."""
    leased: dict[str, int] = field(default_factory=dict)
    """Environment name -> groups leased from it (status)."""
    releases: int = 0
    lease_seed: str = ""
    """Part of every group id the run leases (main.py): a restarted controller's leases get the same ids."""
    poisoned: int = 0
    """Groups poisoned so far (poison.py): a restarted controller goes on counting toward rollout.max_poisoned_groups."""
    doing: dict = field(default_factory=dict)
    """The lease unit begun and not yet saved done (main.py), which a restarted controller redoes; {} between units."""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> RunState:
        return cls(**json.loads(data))


class StateStore:
    """RunState in the run's KV bucket (history 1: only the latest matters)."""

    def __init__(self, js, kv) -> None:
        self.js = js
        self.kv = kv
        self._last = b""
        self._stored: set[str] = set()
        """Group ids whose lease is in the bucket."""

    @classmethod
    async def open(cls, js, run: str) -> StateStore:
        return cls(js, await open_state_bucket(js, run))

    async def load(self) -> RunState | None:
        try:
            entry = await self.kv.get(KEY)
        except KeyNotFoundError:
            return None
        return RunState.decode(entry.value)

    async def save_leases(self, leased: dict[str, types_pb2.PromptGroup]) -> None:
        """The bucket's leases become `leased`: new ones put, consumed or re-leased ones purged."""
        # A copy: stale and filtered groups leave `leased` while this awaits the bucket.
        now = dict(leased)
        for gid in now.keys() - self._stored:
            await self.kv.put(LEASE + gid, now[gid].SerializeToString())
        for gid in self._stored - now.keys():
            await self.kv.purge(LEASE + gid)
        self._stored = set(now)

    async def load_leases(self) -> dict[str, types_pb2.PromptGroup]:
        out = {key.removeprefix(LEASE): types_pb2.PromptGroup.FromString(value)
               for key, value in (await self._values(LEASE)).items()}
        self._stored = set(out)
        return out

    async def save_submitted(self, spec: controller_pb2.EnvironmentSpec) -> None:
        """An environment a client submitted, rows included, so a restarted controller has it in the mix again."""
        await self.kv.put(SUBMITTED + spec.name, spec.SerializeToString())

    async def forget_submitted(self, name: str) -> None:
        await self.kv.purge(SUBMITTED + name)

    async def load_submitted(self) -> list[controller_pb2.EnvironmentSpec]:
        """The submitted environments still in the mix."""
        values = await self._values(SUBMITTED)
        return [controller_pb2.EnvironmentSpec.FromString(v) for v in values.values()]

    async def _values(self, prefix: str) -> dict[str, bytes]:
        return await read_prefixed(self.js, self.kv, prefix)

    async def save_validated(self, version: int, metrics: dict[str, float]) -> None:
        """A validation's metrics, for the trainer to rank checkpoints by (checkpointing.metric_name val:...)."""
        await self.kv.put(f"{VALIDATED}{version}", json.dumps(metrics).encode())

    async def save_validating(self, version: int) -> None:
        """A validation requested: a controller killed before it is done runs it when it starts again."""
        await self.kv.put(f"{VALIDATING}{version}", b"")

    async def forget_validating(self, version: int) -> None:
        await self.kv.purge(f"{VALIDATING}{version}")

    async def load_validating(self) -> list[int]:
        """Versions whose validation was requested and neither finished nor failed, oldest first."""
        return sorted(int(key.removeprefix(VALIDATING)) for key in await self._values(VALIDATING))

    async def save(self, state: RunState) -> None:
        data = state.encode()
        if data != self._last:  # most lease windows change nothing
            await self.kv.put(KEY, data)
            self._last = data

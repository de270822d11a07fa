"""Every public rpc of a running stack, and the traffic a stray or hostile client sends it.

`RPCS` names each rpc with its request type and whether it is internal (run token) or the
controller's admin API. `hostile(rpc, state, rng, step)` makes structurally valid requests meant to hurt the
run: Commit far ahead, Sample of old and future steps and of another shape, Remove of the only
environment, Register of a bogus address or over a live name, and so on.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common.pb.flywheel.v1 import (controller_pb2, environment_pb2, replay_pb2, rollout_pb2, trainer_pb2,
                                            types_pb2)


@dataclass(frozen=True, slots=True)
class Rpc:
    service: str
    """Key of the address in cfg.addresses."""
    method: str
    request: type
    internal: bool = True
    """Needs the run token; the controller's admin API does not."""

    @property
    def path(self) -> str:
        return f"/flywheel.v1.{self.method}"

    @property
    def short(self) -> str:
        return self.method.split("/")[1]

    @property
    def name(self) -> str:
        return f"{self.service}.{self.short}"


RPCS = [
    Rpc("controller", "ControllerService/SubmitEnvironment", controller_pb2.SubmitEnvironmentRequest, internal=False),
    Rpc("controller", "ControllerService/ListEnvironments", controller_pb2.ListEnvironmentsRequest, internal=False),
    Rpc("controller", "ControllerService/RemoveEnvironment", controller_pb2.RemoveEnvironmentRequest, internal=False),
    Rpc("controller", "ControllerService/Status", controller_pb2.StatusRequest, internal=False),
    Rpc("environment", "EnvironmentService/Step", environment_pb2.StepRequest),
    Rpc("environment", "EnvironmentService/Register", environment_pb2.RegisterRequest),
    Rpc("environment", "EnvironmentService/Unregister", environment_pb2.UnregisterRequest),
    Rpc("environment", "EnvironmentService/List", environment_pb2.ListRequest),
    Rpc("environment", "EnvironmentService/Prompts", environment_pb2.PromptsRequest),
    Rpc("replay", "ReplayService/Sample", replay_pb2.SampleRequest),
    Rpc("replay", "ReplayService/Stats", replay_pb2.StatsRequest),
    Rpc("replay", "ReplayService/Commit", replay_pb2.CommitRequest),
    Rpc("rollout", "RolloutService/Generate", rollout_pb2.GenerateRequest),
    Rpc("trainer", "TrainerService/Status", trainer_pb2.TrainerServiceStatusRequest),
]


@dataclass(kw_only=True, slots=True)
class RunState:
    """What the hostile client knows of the run it attacks."""

    env_name: str
    prompts_per_step: int
    max_staleness: int
    trained: Callable[[], int]
    """Steps finished so far (metrics rows)."""


def garbage(rng: random.Random) -> bytes:
    """Random bytes; one in eight is a corrupt length-delimited field, which never decodes."""
    if rng.random() < 0.125:
        return b"\x0a\xff\xff\xff\xff\x0f" + rng.randbytes(rng.randrange(8))
    return rng.randbytes(rng.randrange(1, 96))


def _msg(text: str) -> types_pb2.ChatMessage:
    return types_pb2.ChatMessage(role="user", content=text)


def hostile(rpc: Rpc, state: RunState, rng: random.Random, step: int):
    """One structurally valid, hostile request for `rpc`, and a label for the tally; `step`: steps trained."""
    name = rpc.short
    if name == "Commit":
        return rng.choice([
            ("far ahead", replay_pb2.CommitRequest(step=step + rng.randrange(50, 10**9))),
            ("negative", replay_pb2.CommitRequest(step=-rng.randrange(1, 10**9))),
            ("just ahead", replay_pb2.CommitRequest(step=step + 2)),
        ])
    if name == "Sample":
        k, n = state.max_staleness, state.prompts_per_step
        return rng.choice([
            ("future", replay_pb2.SampleRequest(step=step + rng.randrange(3, 10**6), prompts_per_step=n,
                                                max_staleness=k)),
            ("old", replay_pb2.SampleRequest(step=rng.randrange(0, max(1, step)), prompts_per_step=n,
                                             max_staleness=k)),
            ("other shape", replay_pb2.SampleRequest(step=step, prompts_per_step=rng.randrange(1, 10**6),
                                                     max_staleness=rng.randrange(0, 100))),
            ("negative", replay_pb2.SampleRequest(step=-1, prompts_per_step=n, max_staleness=k)),
        ])
    if name == "RemoveEnvironment":
        return rng.choice([("only environment", controller_pb2.RemoveEnvironmentRequest(name=state.env_name)),
                           ("unknown", controller_pb2.RemoveEnvironmentRequest(name=f"nope-{rng.randrange(99)}"))])
    if name == "SubmitEnvironment":
        spec = rng.choice([
            ("bogus address", controller_pb2.EnvironmentSpec(name=f"evil{rng.randrange(99)}", address="127.0.0.1:1")),
            ("live name", controller_pb2.EnvironmentSpec(name=state.env_name, kind="math")),
            ("bad weight", controller_pb2.EnvironmentSpec(name="w", kind="toy_copy", weight=-1)),
            ("unknown kind", controller_pb2.EnvironmentSpec(name="k", kind="rm -rf")),
            ("system file", controller_pb2.EnvironmentSpec(name="f", kind="toy_copy", jsonl_path="/etc/passwd")),
        ])
        return spec[0], controller_pb2.SubmitEnvironmentRequest(spec=spec[1])
    if name == "Register":
        return rng.choice([
            ("bogus address", environment_pb2.RegisterRequest(name=f"evil{rng.randrange(99)}", address="127.0.0.1:1")),
            ("over a live name", environment_pb2.RegisterRequest(name=state.env_name, kind="math")),
            ("bad name", environment_pb2.RegisterRequest(name="../../etc", kind="toy_copy")),
        ])
    if name == "Unregister":
        return "unknown", environment_pb2.UnregisterRequest(name=f"nope-{rng.randrange(99)}")
    if name == "Step":
        return rng.choice([
            ("unknown env", environment_pb2.StepRequest(env_name="nope", episodes=[environment_pb2.Episode()])),
            ("no episodes", environment_pb2.StepRequest(env_name=state.env_name)),
            ("junk answer", environment_pb2.StepRequest(env_name=state.env_name, episodes=[
                environment_pb2.Episode(messages=[_msg("x"), types_pb2.ChatMessage(role="assistant",
                                                                                 content=rng.randbytes(8).hex())])])),
        ])
    if name == "Prompts":
        return rng.choice([
            ("count out of range", environment_pb2.PromptsRequest(env_name=state.env_name,
                                                                   count=rng.choice([0, -1, 100_001]))),
            ("negative offset", environment_pb2.PromptsRequest(env_name=state.env_name, count=1, offset=-5)),
            ("unknown env", environment_pb2.PromptsRequest(env_name="nope", count=1)),
        ])
    if name == "Generate":
        return rng.choice([
            ("too many", rollout_pb2.GenerateRequest(messages=[_msg("hi")], n=rng.choice([0, 65, 10**6]))),
            ("no messages", rollout_pb2.GenerateRequest(n=1)),
        ])
    return "read-only", rpc.request()


@dataclass(slots=True)
class Tally:
    """(rpc, kind, label) -> status code name -> count."""

    counts: dict = field(default_factory=lambda: collections.defaultdict(collections.Counter))

    def add(self, rpc: Rpc, kind: str, label: str, code: grpc.StatusCode) -> None:
        self.counts[(rpc.name, kind, label)][code.name] += 1

    def codes(self, name: str | None = None, kind: str | None = None, label: str | None = None) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for (n, k, lab), counter in self.counts.items():
            if (name in (None, n)) and (kind in (None, k)) and (label in (None, lab)):
                out += counter
        return out


async def call(ch: grpc.aio.Channel, rpc: Rpc, payload) -> grpc.StatusCode:
    """One call with raw bytes or a message; its status code."""
    raw = payload if isinstance(payload, bytes) else payload.SerializeToString()
    try:
        await ch.unary_unary(rpc.path)(raw, timeout=60)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        return err.code()


async def flood(rpc: Rpc, authed: grpc.aio.Channel, bare: grpc.aio.Channel, state: RunState, tally: Tally, *,
                each: int, seed: int, concurrency: int = 4) -> None:
    """`each` random and `each` hostile calls to `rpc`, half of each without the run token."""
    rng = random.Random(seed)
    jobs = []
    step = state.trained()  # once: read per job, the growing metrics file made building the jobs outlast short runs
    for i in range(each):
        jobs.append(("random", "garbage", garbage(rng), i % 2 == 0))
        label, request = hostile(rpc, state, rng, step)
        jobs.append(("hostile", label, request, i % 2 == 0))
    rng.shuffle(jobs)
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)

    async def worker() -> None:
        while not queue.empty():
            kind, label, payload, with_token = queue.get_nowait()
            code = await call(authed if with_token else bare, rpc, payload)
            tally.add(rpc, f"{kind}/{'token' if with_token else 'no token'}", label, code)

    await asyncio.gather(*(worker() for _ in range(concurrency)))

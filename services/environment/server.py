"""The EnvironmentService servicer: decode, call the environment, encode.

Built-in environments run in a worker thread (a verifier or the code sandbox may take a
while; the event loop keeps answering). Registered remote environments are called
through `RemoteEnvironment`: a call it gets no usable answer for is answered UNAVAILABLE (rollout then
hands the group back; nothing is scored), and its retries stay inside the deadline of the Step call that asked.

Unregister retires a name rather than forgetting it at once: groups leased before the
controller removed the environment still find it for `RETIRED_GRACE_S`, so they finish. A retired
remote that gives no answer is answered NOT_FOUND at once, as after its grace: it will not come back
to the mix, so its groups are dropped and replaced rather than handed back until the grace ends.
"""

from __future__ import annotations

import asyncio
import re
import time

from opentelemetry import trace

from services.common.config import REWARD_MODEL
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable, require
from services.common.messages import dataset_row, message_from_dict, message_to_dict
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.structs import from_struct, to_struct
from services.environment.agents import AgentError
from services.environment.agents.service import AgentEnvironment
from services.environment.base import BUILTIN, Environment, StepResult, UnknownEnvironment, make_environment
from services.environment.remote import DEFAULT_TIMEOUT_S, RemoteEnvironment

NAME = re.compile(r"^[a-z0-9_-]{1,64}$")
tracer = trace.get_tracer("flywheel.environment")
RETIRED_GRACE_S = 600.0
"""How long an unregistered environment still serves Step for groups leased before its removal."""
Named = Environment | RemoteEnvironment | AgentEnvironment
MAX_TIMEOUT_S = 86400.0
"""A remote's per-call deadline, at most. gRPC cannot represent one past ~292 years (inf, 1e10) and fails such
a call at once with DEADLINE_EXCEEDED: every Prompts of the remote would have been UNAVAILABLE."""
MAX_PROMPTS = 10_000
"""Rows one Prompts call may ask for: 10,000 generated puzzles are ~1 s of CPU and a 6 MB answer here (100,000
were 10 s, and over a minute on a host running two test suites). The controller asks for 256 at a time."""


def decode_episodes(request: environment_pb2.StepRequest) -> tuple[list[list[dict]], list[dict]]:
    conversations = [[message_to_dict(m) for m in e.messages] for e in request.episodes]
    metadata = []
    for i, e in enumerate(request.episodes):
        try:
            metadata.append(from_struct(e.metadata))
        except ValueError as err:  # a Struct number that JSON cannot hold (nan, inf)
            raise InvalidArgument(f"episodes[{i}].metadata: {err}") from None
    return conversations, metadata


def encode_result(r: StepResult) -> environment_pb2.EpisodeResult:
    out = environment_pb2.EpisodeResult(
        observation=types_pb2.ChatMessage(role="environment", content=r.observation), reward=r.reward,
        named_rewards=r.named_rewards, terminated=r.terminated, next_stop_strings=r.next_stop_strings or [],
        answer=r.answer or "", error=r.error, observations=[message_from_dict(m) for m in r.messages or []])
    if r.metadata is not None:
        out.metadata.CopyFrom(to_struct(r.metadata))
    return out


def _prompts(env: Environment, request: environment_pb2.PromptsRequest) -> environment_pb2.PromptsResponse:
    rows = env.prompts(request.count, request.seed, request.offset) or []
    return environment_pb2.PromptsResponse(rows=[dataset_row(r) for r in rows])


async def _agent_prompts(name: str, env: AgentEnvironment, request) -> environment_pb2.PromptsResponse:
    """The tasks an agent's environment lists itself (a verifiers taskset); refused for one that lists none."""
    try:
        rows = await env.agent.prompts(request.count, request.seed, request.offset)
    except AgentError as err:
        raise InvalidArgument(f"agent environment {name!r} could not list its tasks: {err}") from None
    if rows is None:
        raise InvalidArgument(f"agent environment {name!r} generates no prompts: give it a dataset")
    return environment_pb2.PromptsResponse(rows=[dataset_row(r) for r in rows])


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Named environments: built-ins by kind (always available under their kind) and registered names."""

    def __init__(self, settings: dict[str, dict] | None = None, reward_model: RemoteEnvironment | None = None) -> None:
        self.settings = settings or {}
        """Keyword arguments of each built-in kind (the config's env section, e.g. {"math": {"num_workers": 8}})."""
        self.reward_model = reward_model
        """The run's reward-model server, which scores the kind reward_model; None when the config uses none."""
        self.named: dict[str, Named] = {}
        self.sources: dict[str, str] = {}
        self.retired: dict[str, tuple[Named, float]] = {}  # name -> (env, retired at)

    def resolve(self, name: str) -> Named:
        if name in self.named:
            return self.named[name]
        if name in self.retired and time.monotonic() - self.retired[name][1] <= RETIRED_GRACE_S:
            return self.retired[name][0]
        try:
            self.named[name] = self._builtin(name)
        except UnknownEnvironment as err:
            raise NotFound(f"no environment named {name!r}: {err}") from None
        self.sources[name] = f"builtin:{name}"
        return self.named[name]

    def _builtin(self, kind: str) -> Named:
        if kind != REWARD_MODEL:
            return make_environment(kind, self.settings)
        if self.reward_model is None:
            raise UnknownEnvironment(f"kind {REWARD_MODEL!r} needs env.reward_model.model_name in the run's config "
                                     f"(this service was started without it)")
        return self.reward_model

    async def Step(self, request, context):
        require(request.env_name != "", "env_name is required")
        require(len(request.episodes) > 0, "episodes must not be empty")
        env = self.resolve(request.env_name)
        if isinstance(env, AgentEnvironment):
            raise FailedPrecondition(f"environment {request.env_name!r} is an agent environment: rollout runs its "
                                     "episodes through AgentService.RunAgent, not Step")
        # A child of the caller's span (the rollout group's trace) when the call carries a traceparent.
        with tracer.start_as_current_span("environment.step", attributes={
                "flywheel.env": request.env_name, "flywheel.episodes": len(request.episodes)}) as span:
            if isinstance(env, RemoteEnvironment):
                results = await self._remote_step(request.env_name, env, request, context.time_remaining())
            else:
                conversations, metadata = decode_episodes(request)
                results = await asyncio.to_thread(env.step, conversations, metadata,
                                                  return_extracted_answer=request.return_extracted_answer)
            span.set_attribute("flywheel.reward_mean", sum(r.reward for r in results) / max(1, len(results)))
        return environment_pb2.StepResponse(results=[encode_result(r) for r in results])

    async def _remote_step(self, name: str, env: RemoteEnvironment, request, budget_s: float | None):
        try:
            return await env.step(request, budget_s=budget_s)
        except Unavailable as err:
            if name in self.named:
                raise  # in the mix: rollout hands the group back until the remote answers again
            # Removed from the mix and not answering: waiting out its grace would only stall the steps these groups
            # were leased for. NOT_FOUND makes rollout announce the group stale; the controller leases a prompt of
            # the mix in its place.
            raise NotFound(f"environment {name!r} was removed from the mix and does not answer ({err}); "
                           "its group is dropped") from None

    async def Register(self, request, context):
        require(bool(NAME.match(request.name)), f"name must match {NAME.pattern}, got {request.name!r}")
        require(bool(request.kind) != bool(request.address), "set exactly one of kind or address")
        require(0 <= request.timeout_seconds <= MAX_TIMEOUT_S,
                f"timeout_seconds must be in [0, {MAX_TIMEOUT_S:g}], got {request.timeout_seconds}")
        current = self.sources.get(request.name)
        if current is not None and current == (f"builtin:{request.kind}" if request.kind else request.address):
            return environment_pb2.RegisterResponse()  # already so (a restarted controller registers again)
        if current is not None:
            raise AlreadyExists(f"environment {request.name!r} is registered to {current}; a Register for another "
                                "source does not replace it (Unregister it first)")
        if request.kind:
            try:
                env = self._builtin(request.kind)
            except UnknownEnvironment as err:
                raise InvalidArgument(str(err)) from None
            source = f"builtin:{request.kind}"
        else:
            require(":" in request.address, f"address must be host:port, got {request.address!r}")
            env = RemoteEnvironment(request.name, request.address,
                                    timeout_s=request.timeout_seconds or DEFAULT_TIMEOUT_S)
            await env.check_reachable()
            source = request.address
        await self.install(request.name, env, source)
        return environment_pb2.RegisterResponse()

    async def install(self, name: str, env: Named, source: str) -> None:
        """Serves `env` under `name` (List shows `source`), retiring what had the name. A built-in kind's name
        serves only that kind, so a Step to it reaches the built-in whatever else was registered."""
        if name in BUILTIN and source != f"builtin:{name}":
            raise InvalidArgument(f"{name!r} is the name of a built-in kind and serves only that kind; register "
                                  f"{source} under a name of its own")
        await self._drop(name)
        await self._forget_retired(name)
        self.named[name], self.sources[name] = env, source

    async def Unregister(self, request, context):
        await self._drop(request.name)
        return environment_pb2.UnregisterResponse()

    async def _drop(self, name: str) -> None:
        """Retires `name`: it leaves List, and Step still serves it for RETIRED_GRACE_S."""
        old = self.named.pop(name, None)
        self.sources.pop(name, None)
        now = time.monotonic()
        for stale in [n for n, (_, at) in self.retired.items() if now - at > RETIRED_GRACE_S]:
            await self._forget_retired(stale)
        if old is not None:
            await self._forget_retired(name)
            self.retired[name] = (old, now)

    async def close_agents(self) -> None:
        """Close every agent environment, registered or retired, at once (the service is stopping)."""
        envs = [*self.named.values(), *(env for env, _ in self.retired.values())]
        await asyncio.gather(*(env.close() for env in envs if isinstance(env, AgentEnvironment)))

    async def _forget_retired(self, name: str) -> None:
        old, _ = self.retired.pop(name, (None, 0.0))
        if isinstance(old, (RemoteEnvironment, AgentEnvironment)) and old is not self.reward_model:
            await old.close()  # not the reward model: that one serves every name of its kind

    async def List(self, request, context):
        kinds = [*BUILTIN, REWARD_MODEL] if self.reward_model is not None else list(BUILTIN)
        return environment_pb2.ListResponse(builtin_kinds=sorted(kinds), registered=self.sources)

    async def Prompts(self, request, context):
        require(1 <= request.count <= MAX_PROMPTS, f"count must be in 1..{MAX_PROMPTS}, got {request.count}")
        require(request.offset >= 0, f"offset must be >= 0, got {request.offset}")
        env = self.resolve(request.env_name)
        if isinstance(env, AgentEnvironment):
            return await _agent_prompts(request.env_name, env, request)
        if isinstance(env, RemoteEnvironment):
            return await env.prompts(request)
        # In a worker thread, as Step: 10,000 generated rows take a second, and Step calls must not wait for them.
        return await asyncio.to_thread(_prompts, env, request)

"""The AgentService servicer: registers agent environments and runs one episode per RunAgent.

Agent environments live in the EnvironmentServicer's table beside built-ins and remotes, so List shows them
(`agent:<type>`), Unregister retires them with the same grace, and a restarted controller's Register again
finds them. RunAgent runs `Agent.run` under the episode's deadline; a failed episode (deadline, crash,
malformed reward) is answered with `error` set and counted in `flywheel_agent_episodes_failed_total`,
never trained: rollout drops the group and the controller leases its prompt again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, require
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc
from services.common.structs import from_struct
from services.environment.agents import Agent, AgentEpisode, AgentError
from services.environment.agents.registry import UnknownAgent, make_agent

NAME = re.compile(r"^[a-z0-9_-]{1,64}$")
log = logging.getLogger("flywheel.environment.agents")
tracer = trace.get_tracer("flywheel.environment")
DEFAULT_DEADLINE_S = 60.0
MAX_DEADLINE_S = 86400.0
EPISODES = Counter("flywheel_agent_episodes_total", "Agent episodes run", ["env"])
FAILED = Counter("flywheel_agent_episodes_failed_total", "Agent episodes that failed (not trained)",
                 ["env", "reason"])
SECONDS = Histogram("flywheel_agent_episode_seconds", "Wall time of one agent episode", ["env"],
                    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))


@dataclass(kw_only=True, slots=True)
class AgentEnvironment:
    """A registered agent environment: its agent, spec and per-episode deadline."""

    agent: Agent
    spec: dict
    deadline_s: float

    @property
    def source(self) -> str:
        return f"agent:{self.spec.get('type')}"

    async def close(self) -> None:
        await self.agent.close()


class AgentServicer(environment_pb2_grpc.AgentServiceServicer):
    def __init__(self, environments) -> None:
        self.environments = environments
        """The EnvironmentServicer whose table holds every named environment."""

    async def RegisterAgent(self, request, context):
        envs = self.environments
        require(bool(NAME.match(request.name)), f"name must match {NAME.pattern}, got {request.name!r}")
        require(0 <= request.timeout_seconds <= MAX_DEADLINE_S,
                f"timeout_seconds must be in [0, {MAX_DEADLINE_S:g}], got {request.timeout_seconds}")
        spec = from_struct(request.agent)
        current = envs.named.get(request.name)
        if isinstance(current, AgentEnvironment) and current.spec == spec:
            return environment_pb2.RegisterAgentResponse()  # already so (a restarted controller registers again)
        if current is not None:
            raise AlreadyExists(f"environment {request.name!r} is registered to {envs.sources[request.name]}; "
                                "a Register for another source does not replace it (Unregister it first)")
        try:
            agent = make_agent(spec)
        except UnknownAgent as err:
            raise InvalidArgument(f"environment {request.name!r}: {err}") from None
        env = AgentEnvironment(agent=agent, spec=spec, deadline_s=request.timeout_seconds or DEFAULT_DEADLINE_S)
        await envs.install(request.name, env, env.source)
        return environment_pb2.RegisterAgentResponse()

    async def RunAgent(self, request, context):
        env = self._agent(request.env_name)
        require(bool(request.base_url) and bool(request.api_key), "base_url and api_key are required")
        require(request.deadline_s >= 0, f"deadline_s must be >= 0, got {request.deadline_s}")
        try:
            task = json.loads(request.task_json or "{}")
        except json.JSONDecodeError as err:
            raise InvalidArgument(f"task_json: {err}") from None
        require(isinstance(task, dict), "task_json must be a JSON object")
        deadline = min(env.deadline_s, request.deadline_s or env.deadline_s)
        episode = AgentEpisode(base_url=request.base_url, api_key=request.api_key, model=request.model,
                               task=task, deadline_s=deadline)
        with tracer.start_as_current_span("environment.agent", attributes={
                "flywheel.env": request.env_name, "flywheel.agent": env.source}) as span:
            response = await run_episode(request.env_name, env.agent, episode)
            span.set_attributes({"flywheel.reward": response.reward, "flywheel.error": response.error_reason})
        return response

    def _agent(self, name: str) -> AgentEnvironment:
        env = self.environments.resolve(name)
        if not isinstance(env, AgentEnvironment):
            raise FailedPrecondition(f"environment {name!r} is not an agent environment: rollout runs it through Step")
        return env

    async def DescribeEnvironment(self, request, context):
        env = self.environments.resolve(request.env_name)
        kind = env.spec.get("type", "") if isinstance(env, AgentEnvironment) else ""
        return environment_pb2.DescribeEnvironmentResponse(agent_type=kind)


async def run_episode(name: str, agent: Agent, episode: AgentEpisode) -> environment_pb2.RunAgentResponse:
    """One episode under its deadline; a failure is an answer with `error` set, counted by reason."""
    EPISODES.labels(name).inc()
    t0 = time.perf_counter()
    try:
        result = await asyncio.wait_for(agent.run(episode), episode.deadline_s)
    except (AgentError, TimeoutError) as err:
        reason = "deadline" if isinstance(err, TimeoutError) else err.reason
        detail = f"no reward within {episode.deadline_s:g} s" if reason == "deadline" else str(err)
        FAILED.labels(name, reason).inc()
        log.warning("agent episode of %s failed (%s): %s", name, reason, detail[:500])
        return environment_pb2.RunAgentResponse(error=detail or reason, error_reason=reason,
                                                seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    SECONDS.labels(name).observe(seconds)
    return environment_pb2.RunAgentResponse(reward=result.reward, metrics=result.metrics,
                                            named_rewards=result.named_rewards, seconds=seconds)

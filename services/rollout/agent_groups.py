"""Prompt groups of agent environments: G episodes on the worker's endpoint, each run by the environment service.

    PromptGroup ──open G episodes──▶ endpoint (session key, token, base URL each)
         │                                ▲  the agent's model calls, recorded token by token
         └─ G × AgentService.RunAgent ──▶ environment service runs the agent (deadline) ──▶ reward
    close G episodes ──samples + rewards──▶ TrajectoryGroup (published as any other)

From episodes to a group: every sample an episode's calls left is one completion carrying its episode's reward
(times the environment's reward_scale), as NeMo RL does for NeMo Gym episodes of several samples. An episode
whose agent never called the model gives one empty completion with its reward: no loss token, but its reward
still counts in the group's baseline. GRPO normalizes over the group's completions, so an episode of k samples
weighs k times in the baseline; with agents that keep to one conversation (the endpoint then records one
sample per episode) the group is G completions, exactly as the built-in loop's.

Generate (validation, `flywheel eval`, `flywheel collect`) runs the same episodes (`episodes`) and answers one
completion per episode instead (`episode_completion`): its longest sample, the conversation its last chat call
recorded after the prompt, its agent's reward, named rewards and metrics. Nothing hands a Generate call back, so
there a failed episode runs again, alone and in a fresh session, up to rollout.max_group_failures attempts (as
many as a training group's deliveries); only an episode that fails every time fails the call.

Failures: an episode whose agent failed (deadline, crash, malformed reward) or a group with no model call at
all raises AgentFailed; the worker hands the group back, so its prompt runs again, and poisons it at
rollout.max_group_failures deliveries (an agent that always fails on it: the controller leases a new prompt). Each
episode is closed the moment its RunAgent returns (or fails), so a call its agent (or anything the agent left
running) makes after that is refused (410), and nothing it sends reaches another episode, each of which has its
own session key and token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from google.protobuf import json_format
from prometheus_client import Counter

from services.common.messages import message_from_dict
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.structs import from_struct
from services.rollout.endpoint.trajectory import Sample, Trajectory, group_rows

log = logging.getLogger("flywheel.rollout.agents")
KIND_TTL_S = 10.0
"""Seconds rollout trusts what it was told an environment name is (a removed name may come back as another)."""
DEADLINE_SHARE = 0.9
"""Share of rollout.step_timeout_s an episode may take, so the RunAgent call ends before its own deadline."""
FAILED_GROUPS = Counter("flywheel_rollout_agent_groups_failed_total",
                        "Agent group runs that failed because an episode failed (the group is handed back)",
                        ["env", "reason"])
RETRIED = Counter("flywheel_rollout_agent_episodes_retried_total",
                  "Generate's agent episodes that failed and ran again (validation, eval, collect)", ["env", "reason"])
SAMPLES = Counter("flywheel_rollout_agent_samples_total", "Completions built from agent episodes' samples", ["env"])


class AgentFailed(Exception):
    """An episode of the group failed; the group is dropped, not trained."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class AgentGroups:
    def __init__(self, agents: environment_pb2_grpc.AgentServiceStub, *, model: str, step_timeout_s: float) -> None:
        self.agents = agents
        self.model = model
        self.step_timeout_s = step_timeout_s
        self._kinds: dict[str, tuple[str, float]] = {}  # env name -> (agent type, when asked)

    async def is_agent(self, env_name: str) -> bool:
        """Whether the environment service runs `env_name`'s episodes with an agent (cached for KIND_TTL_S)."""
        cached = self._kinds.get(env_name)
        if cached is None or time.monotonic() - cached[1] > KIND_TTL_S:
            response = await self.agents.DescribeEnvironment(
                environment_pb2.DescribeEnvironmentRequest(env_name=env_name), timeout=10, wait_for_ready=True)
            cached = self._kinds[env_name] = (response.agent_type, time.monotonic())
        return bool(cached[0])

    async def run(self, group: types_pb2.PromptGroup, endpoint, version: int, worker_id: str
                  ) -> types_pb2.TrajectoryGroup:
        """Runs the group's G episodes at once on `endpoint` (the worker's EndpointServer)."""
        t0 = time.perf_counter()
        trajectories, results = await self.episodes(group, endpoint)
        out = build_group(group, trajectories, results, version)
        SAMPLES.labels(group.env_name).inc(len(out.completions))
        out.worker_id, out.generation_seconds = worker_id, time.perf_counter() - t0
        return out

    async def episodes(self, group: types_pb2.PromptGroup, endpoint, attempts: int = 1
                       ) -> tuple[list[Trajectory], list[environment_pb2.RunAgentResponse]]:
        """The group's G episodes, run at once on `endpoint`: what each recorded and what its agent answered, each
        episode tried up to `attempts` times. Training (`run`, one attempt: a failed group is handed back whole)
        and Generate (eval, collect, validation: episode_completion) both run them here."""
        if endpoint is None:
            raise AgentFailed("no_endpoint", "this worker serves no endpoint (policy.generation.endpoint.enabled)")
        task = task_json(group)
        try:
            async with asyncio.TaskGroup() as tasks:  # one episode failing cancels the others (agents stop)
                episodes = [tasks.create_task(self._episode(group, endpoint, i, task, attempts))
                            for i in range(group.num_generations)]
        except ExceptionGroup as errors:  # the worker tells failures apart: the first as it came
            first = errors.exceptions[0]
            if isinstance(first, AgentFailed):
                FAILED_GROUPS.labels(group.env_name, first.reason).inc()
            raise first from None
        trajectories, results = zip(*(e.result() for e in episodes))
        return list(trajectories), list(results)

    async def completions(self, group: types_pb2.PromptGroup, endpoint, version: int, decode, attempts: int
                          ) -> list[types_pb2.Completion]:
        """Generate's answer for an agent environment: the group's episodes, one completion each
        (episode_completion), run as training runs them, a failed one again up to `attempts` times in all."""
        trajectories, results = await self.episodes(group, endpoint, attempts)
        return [episode_completion(t, r, scale=group.reward_scale or 1.0, version=version, decode=decode)
                for t, r in zip(trajectories, results, strict=True)]

    async def _episode(self, group: types_pb2.PromptGroup, endpoint, index: int, task: str, attempts: int
                       ) -> tuple[Trajectory, environment_pb2.RunAgentResponse]:
        """One episode: open, run its agent, close as soon as the agent is done (its later calls get 410); a
        failed attempt's recording is dropped with its session."""
        for attempt in range(1, attempts + 1):
            key, token, url = endpoint.open_episode(
                metadata={"group_id": group.group_id, "episode": index},
                sampling=group.sampling if group.HasField("sampling") else None)
            try:
                request = environment_pb2.RunAgentRequest(
                    env_name=group.env_name, base_url=url, api_key=token, model=self.model, task_json=task,
                    deadline_s=self.step_timeout_s * DEADLINE_SHARE)
                result = await self.agents.RunAgent(request, timeout=self.step_timeout_s, wait_for_ready=True)
            finally:
                trajectory = endpoint.close_episode(key)
            if not result.error:
                return trajectory, result
            if attempt < attempts:
                RETRIED.labels(group.env_name, result.error_reason).inc()
                log.warning("group %s episode %d: attempt %d of %d failed (%s: %s); running it again",
                            group.group_id, index, attempt, attempts, result.error_reason, result.error[:200])
        # The group fails: its other agents are stopped now rather than waited for.
        raise AgentFailed(result.error_reason, result.error)


def episode_completion(trajectory: Trajectory, result: environment_pb2.RunAgentResponse, *, scale: float,
                       version: int, decode) -> types_pb2.Completion:
    """One episode as Generate answers it (eval, collect, validation): its longest sample's tokens after that
    sample's first prompt and the text `decode` makes of them, the recorded conversation after its prompt, and
    its agent's reward and named rewards (times `scale`, as build_group) and metrics. Pure but for `decode`."""
    sample = max(trajectory.samples, key=lambda s: len(s.token_ids), default=Sample())
    _, (row,) = group_rows([sample])
    if row["version_start"] < 0:  # no model call: the version loaded now, as build_group does
        row["version_start"] = row["version_end"] = version
    text = decode(row["token_ids"])
    return types_pb2.Completion(
        **row, reward=result.reward * scale, named_rewards={k: v * scale for k, v in result.named_rewards.items()},
        metrics=dict(result.metrics), text=text, turns=trajectory.calls,
        messages=[message_from_dict(m) for m in episode_messages(trajectory.conversation, text)])


def episode_messages(conversation: list[dict], text: str) -> list[dict]:
    """What the episode's calls added to its prompt: the recorded conversation from its first assistant message on
    (assistant turns with their tool calls, tool results, the agent's own turns between); an episode of Completions
    calls only, which leave no conversation, its decoded text as one assistant message."""
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first is not None:
        return conversation[first:]
    return [{"role": "assistant", "content": text}] if text else []


def task_json(group: types_pb2.PromptGroup) -> str:
    """The prompt as its dataset row: the row's fields (the group's metadata) and `messages` in OpenAI's shape."""
    messages = [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in group.messages]
    return json.dumps({**from_struct(group.metadata), "messages": messages})


def build_group(group: types_pb2.PromptGroup, trajectories: list[Trajectory],
                results: list[environment_pb2.RunAgentResponse], version: int) -> types_pb2.TrajectoryGroup:
    """Each recorded sample a completion with its episode's reward (module docstring); pure."""
    scale = group.reward_scale or 1.0
    samples: list[Sample] = []
    rewards: list[float] = []
    named: list[dict[str, float]] = []
    for trajectory, result in zip(trajectories, results, strict=True):
        mine = trajectory.samples or [Sample()]  # no model call: an empty completion keeps the reward in the baseline
        samples += mine
        rewards += [result.reward * scale] * len(mine)
        named += [{k: v * scale for k, v in result.named_rewards.items()}] * len(mine)  # as the Step loop scales
    if not any(t.samples for t in trajectories):
        raise AgentFailed("no_calls", f"no agent of group {group.group_id} called the model: nothing to train")
    prompt, rows = group_rows(samples)
    completions = []
    for row, sample, reward, components in zip(rows, samples, rewards, named):
        if row["version_start"] < 0:  # nothing generated: the version loaded now, as the built-in loop does
            row["version_start"] = row["version_end"] = version
        completions.append(types_pb2.Completion(**row, reward=reward, named_rewards=components, turns=sample.calls))
    return types_pb2.TrajectoryGroup(
        group_id=group.group_id, prompt_id=group.prompt_id, env_name=group.env_name, target_step=group.target_step,
        prompt_token_ids=prompt, completions=completions, version_start=min(c.version_start for c in completions),
        leased_at_unix_ns=group.leased_at_unix_ns, finished_at_unix_ns=time.time_ns())

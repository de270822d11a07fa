"""Episodes run by an agent over the OpenAI API (DESIGN.md, "Agents"): the contract every agent kind meets.

    rollout worker ──open_episode──▶ endpoint (session key, token, base URL)
         │                               ▲  every model call, recorded token by token
         └─ RunAgent(episode) ──▶ environment service ──▶ Agent.run: NeMo Gym servers, a verifiers
                                                          environment, any program ──▶ AgentResult

The environment service owns the agent's lifecycle (start, the per-episode deadline, the reward) and never
imports torch; rollout owns generation and recording, and publishes the finished group as for any other
episode. An agent sees only `AgentEpisode`: where the model is and what the task is.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class AgentEpisode:
    """One episode as an agent receives it."""

    base_url: str
    """The OpenAI-compatible base URL of this episode, e.g. http://127.0.0.1:PORT/sessions/<key>/v1 (the SDK's
    base_url: every route under it belongs to this episode)."""
    api_key: str
    """The episode's token (the SDK's api_key); a call without it is refused."""
    model: str
    """The model name to put in requests (any name is accepted; this is the policy's)."""
    task: dict
    """The dataset row of the prompt: `messages` (OpenAI format), `tools`, and whatever else the agent's
    environment reads (ground truth, ids, NeMo Gym's `responses_create_params`, a verifiers row)."""
    deadline_s: float
    """Seconds the agent has for the whole episode; past it the episode fails and costs only itself."""


@dataclass(kw_only=True, slots=True)
class AgentResult:
    """What an agent returns for one episode."""

    reward: float
    """The episode's scalar reward (NeMo Gym's /verify reward, a verifiers rubric's score, a program's)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra named numbers kept with the episode (NeMo Gym's extra verify fields, rubric components)."""
    named_rewards: dict[str, float] = field(default_factory=dict)
    """The reward's components, which GDPO reads (NeMo Gym's verify `reward_components`); empty: none."""


class AgentError(RuntimeError):
    """The episode failed on the agent's side (crash, malformed reward, deadline): it scores nothing and is
    counted; the run goes on."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason
        """Short label for metrics: crash, malformed_reward, deadline, error."""


class Agent(abc.ABC):
    """Runs episodes of one agent environment; one instance serves many concurrent episodes."""

    @abc.abstractmethod
    async def run(self, episode: AgentEpisode) -> AgentResult:
        """Run one episode to its end against `episode.base_url`; raise AgentError when it fails."""

    async def prompts(self, count: int, seed: int, offset: int) -> list[dict] | None:
        """Rows `offset`..`offset + count` of the tasks the agent's environment lists itself (a verifiers
        taskset), as dataset rows ({"messages", "metadata", "tools"}); None when it lists none, so the
        environment needs a dataset. The controller leases them as it leases an environment's generated prompts."""
        return None

    async def close(self) -> None:
        """Stop what the agent started (servers, venv processes)."""

"""The environment domain interface: `Environment`, `StepResult`, and the registry of built-in kinds.

Pure Python, no gRPC: the servicer decodes a StepRequest into plain conversations and metadata dicts,
calls `Environment.step`, and encodes the `StepResult`s. This module (and every built-in) imports only
the standard library and math_verify, never torch.

An environment scores one turn for a batch of episodes. `step` must never raise because one episode is
bad: that episode is scored 0 with `error` set, and the others are scored normally (see `score_each`).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

Conversation = list[dict]
"""OpenAI-style messages, each {"role": str, "content": str}; prompt first, newest assistant turn last. An assistant
message that called tools also has "tool_calls" ([{"id", "type", "function": {"name", "arguments": JSON text}}]), a
tool result "tool_call_id" and "name" (services/common/messages.py)."""


class UnknownEnvironment(ValueError):
    """Raised by `make_environment` for a kind that is not built in."""


@dataclass(kw_only=True, slots=True)
class StepResult:
    """The outcome of one turn of one episode."""

    observation: str
    """Content of the role="environment" message appended to the conversation next (unless `messages` is set)."""
    messages: list[dict] | None = None
    """Messages appended instead of `observation`: one {"role": "tool", "content", "tool_call_id", "name"} per tool
    call of the newest assistant turn, in call order. None: the observation."""
    reward: float = 0.0
    """This turn's reward; the sum of `named_rewards` when those are set."""
    named_rewards: dict[str, float] = field(default_factory=dict)
    """Reward components, e.g. {"reward/correctness": 1.0, "reward/format": 0.5}."""
    terminated: bool = True
    """The episode ended this turn."""
    next_stop_strings: list[str] | None = None
    """Stop strings for the next generation turn; None keeps the current ones."""
    metadata: dict | None = None
    """Environment state for the next turn; None keeps the previous state (and is used on termination)."""
    answer: str | None = None
    """Extracted answer, filled when `return_extracted_answer` is asked; None when there is none."""
    error: str = ""
    """Non-empty when this episode failed (a sandbox limit, bad state, a verifier crash); reward is 0."""

    @classmethod
    def failed(cls, error: str, observation: str = "") -> StepResult:
        """A terminated, zero-reward result that names why the episode failed."""
        return cls(observation=observation or f"Environment: error ({error})", error=error)


class Environment(abc.ABC):
    """Scores turns of episodes; one instance serves many concurrent batches."""

    kind: ClassVar[str]
    """Registry name, e.g. "math"."""

    @abc.abstractmethod
    def step(
        self,
        conversations: list[Conversation],
        metadata: list[dict],
        *,
        return_extracted_answer: bool = False,
    ) -> list[StepResult]:
        """Scores one turn of each episode. Results align with the inputs by index.

        `metadata[i]` is episode i's state from the previous turn (the prompt's metadata on turn 1).
        Raises ValueError only when the two lists differ in length; one bad episode never raises.
        """

    def prompts(self, count: int, seed: int, offset: int) -> list[dict] | None:
        """Rows `offset .. offset+count-1` of a reproducible stream keyed by `seed`.

        Each row is {"messages": [{"role", "content"}, ...], "metadata": {...}}. The default, None,
        means this environment needs a dataset.
        """
        return None


def score_each(
    one: Callable[[Conversation, dict], StepResult],
    conversations: list[Conversation],
    metadata: list[dict],
) -> list[StepResult]:
    """Applies `one` to each episode; an exception fails only that episode, named in `error`."""
    if len(conversations) != len(metadata):
        raise ValueError(f"{len(conversations)} conversations but {len(metadata)} metadata entries")
    results = []
    for conversation, meta in zip(conversations, metadata, strict=True):
        try:
            results.append(one(conversation, meta))
        except Exception as exc:  # on purpose: the contract is per-episode failure, never a failed batch
            results.append(StepResult.failed(f"{type(exc).__name__}: {exc}"))
    return results


def assistant_contents(conversation: Conversation) -> list[str]:
    """The content of every assistant message, oldest first."""
    return [str(m.get("content", "")) for m in conversation if m.get("role") == "assistant"]


def last_assistant(conversation: Conversation) -> str:
    """The newest assistant message's content; "" when there is none."""
    contents = assistant_contents(conversation)
    return contents[-1] if contents else ""


@functools.cache
def _builtin() -> dict[str, type[Environment]]:
    # Imported here, not at the top: every built-in imports this module.
    from services.environment.envs.code import CodeEnvironment
    from services.environment.envs.exact_match import ExactMatchEnvironment
    from services.environment.envs.math import MathEnvironment
    from services.environment.envs.math_multi_reward import MathMultiRewardEnvironment
    from services.environment.envs.sliding_puzzle import SlidingPuzzleEnvironment
    from services.environment.envs.tool_add import ToolAddEnvironment
    from services.environment.envs.toy_copy import ToyCopyEnvironment

    kinds = (MathEnvironment, MathMultiRewardEnvironment, CodeEnvironment, SlidingPuzzleEnvironment,
             ExactMatchEnvironment, ToyCopyEnvironment, ToolAddEnvironment)
    return {cls.kind: cls for cls in kinds}


BUILTIN: dict[str, type[Environment]]
"""Built-in kind -> class. Resolved on first access (PEP 562 `__getattr__`) to break the import cycle."""


def __getattr__(name: str):
    if name == "BUILTIN":
        return _builtin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_environment(kind: str, settings: dict[str, dict] | None = None) -> Environment:
    """A new built-in environment of `kind`, with `settings[kind]` (the config's env.<kind>) as keyword arguments."""
    builtin = _builtin()
    if kind not in builtin:
        raise UnknownEnvironment(
            f"unknown environment kind {kind!r}; built-in kinds are: {', '.join(sorted(builtin))}"
        )
    return builtin[kind](**(settings or {}).get(kind, {}))

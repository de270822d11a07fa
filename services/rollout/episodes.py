"""The multi-turn loop: sample G episodes of one prompt, step the environment each turn.

Per turn, the active episodes are generated in one batch, then scored in one batched
EnvironmentService.Step, shared with the groups that score at the same moment (`StepBatcher`, steps.py).
The observation is appended as tokens with loss mask 0 (tokenized raw, as NeMo RL does) unless
the episode ended.

Tools: a prompt group may offer tools (OpenAI definitions), which the chat template renders into the prompt.
With policy.generation.tool_parser set, each assistant turn of such a group is read for tool calls by vLLM's
parser (tools.py), and the environment's Step sees the assistant message with its `tool_calls`; with
reasoning_parser, its reasoning apart from its content. Each turn is judged for flaws (flaws.py), which its tokens
carry, as the endpoint's turns do. An environment that answers with messages (`observations`: role "tool",
tool_call_id) has them appended as the chat template writes them after the turn (loss mask 0); the generated
tokens of earlier turns are never re-tokenized.

Each episode records the versions that produced its first and last generated token, as the engine reports them
per token (they differ only when weights were swapped in flight). Each engine call is a `rollout.generate` span
of the group's trace (time to first token, tokens, version, worker); docs/observability.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from google.protobuf import struct_pb2
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from services.common.config import GenerationConfig
from services.common.logs import RateLimitedLog
from services.common.messages import message_from_dict, message_to_dict, tools_to_dicts
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.rollout.engines import Engine, Generated, Sampling
from services.rollout.steps import StepBatcher
from services.rollout.tools import (TemplateDrift, load_parser, load_reasoning_parser, observation_text, read_turn,
                                    render)

tracer = trace.get_tracer("flywheel.rollout")
log = logging.getLogger("flywheel.rollout")
_warn = RateLimitedLog(log)
PROMPTS_TOO_LONG = Counter("flywheel_rollout_prompts_too_long_total",
                           "Prompt groups kept out of the loss: the prompt reached data.max_input_seq_length tokens")
KEPT_PROMPT_TOKENS = 4
"""A prompt kept out of the loss travels with its first few tokens only (NeMo RL's processors keep up to 4 per
message): the trainer still gets the group, and never a row of an unbounded prompt."""
TOOL_CALLS = Counter("flywheel_rollout_tool_calls_total", "Tool calls read from generated turns (tool_parser)")
TEMPLATE_DRIFT = Counter("flywheel_rollout_template_drift_total",
                         "Episodes ended because the chat template rewrote earlier turns once tool results followed")
TTFT_SECONDS = Histogram("flywheel_rollout_ttft_seconds", "Time to first token of one engine call (a turn's batch)",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


@dataclass(kw_only=True, slots=True)
class EpisodeState:
    messages: list[dict]
    metadata: struct_pb2.Struct
    """The environment's per-episode state, kept as the message it travels as: it is only ever passed back."""
    stop_strings: list[str]
    token_ids: list[int] = field(default_factory=list)
    generated_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    flaws: list[int] = field(default_factory=list)
    reward: float = 0.0
    named_rewards: dict[str, float] = field(default_factory=dict)
    text: str = ""
    answer: str = ""
    truncated: bool = False
    turns: int = 0
    done: bool = False
    version_start: int = -1
    version_end: int = -1

    def append(self, tokens: list[int], logprobs: list[float] | None, flaws: int = 0) -> None:
        """Generated tokens (with their logprobs, and the turn's TurnFlaw bits), or context (logprobs None)."""
        self.token_ids += tokens
        self.generated_mask += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.flaws += [flaws] * len(tokens)


def prompt_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = render(tokenizer, messages, tools, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


class EpisodeRunner:
    """Runs one PromptGroup to a TrajectoryGroup with an engine and an environment stub."""

    def __init__(self, engine: Engine, env: environment_pb2_grpc.EnvironmentServiceStub, *,
                 generation: GenerationConfig, max_seq_len: int, step_timeout_s: float,
                 max_prompt_len: int | None = None) -> None:
        self.engine = engine
        self.generation = generation
        """policy.generation: the sampling defaults, and the parsers and flaw markers that read each turn."""
        if generation.tool_parser is not None:
            load_parser(generation.tool_parser, engine.tokenizer)
        if generation.reasoning_parser is not None:
            load_reasoning_parser(generation.reasoning_parser, engine.tokenizer)
        self.steps = StepBatcher(env, step_timeout_s)
        self.max_seq_len = max_seq_len
        self.max_prompt_len = min(max_prompt_len or max_seq_len, max_seq_len)
        """data.max_input_seq_length: a prompt of this many tokens or more is kept out of the loss."""

    async def run(self, group: types_pb2.PromptGroup, worker_id: str,
                  generated: Callable[[], Awaitable[None]] | None = None, *, with_messages: bool = False
                  ) -> types_pb2.TrajectoryGroup:
        """With `with_messages`, each completion carries its episode's messages after the prompt (Generate's
        answer, which `flywheel collect` writes as Responses items); the trajectory stream trains on tokens only.

        `generated` is awaited once the group needs the engine no more: after its last possible turn is
        generated, before that turn's Step (or after the Step that ended every episode early). The worker
        gives the group's engine slot to the next group there, so scoring and publishing overlap generation."""
        tok = self.engine.tokenizer
        prompt = [message_to_dict(m) for m in group.messages]
        tools = tools_to_dicts(group.tools) or None
        # Off the event loop: a prompt of megabytes takes seconds to tokenize, and the worker's heartbeats, work queue
        # and rpcs must not wait for it.
        prompt_ids = await asyncio.to_thread(prompt_token_ids, tok, prompt, tools)
        sampling = Sampling.resolve(self.generation, group.sampling)
        episodes = [EpisodeState(messages=list(prompt), metadata=group.metadata,
                                 stop_strings=list(sampling.stop_strings)) for _ in range(group.num_generations)]
        if len(prompt_ids) >= self.max_prompt_len:
            # As NeMo RL's loss_multiplier 0: no generation, no environment call; each completion is empty,
            # truncated and scored 0, so the group adds no loss token to its step.
            PROMPTS_TOO_LONG.inc()
            _warn.warning("too_long", "prompt %s has %d tokens, data.max_input_seq_length %d: kept out of the loss",
                          group.prompt_id, len(prompt_ids), self.max_prompt_len)
            prompt_ids = prompt_ids[:KEPT_PROMPT_TOKENS]
            for e in episodes:
                e.truncated = e.done = True
                e.version_start = e.version_end = self.engine.version
        gen_s = env_s = 0.0
        turns = max(1, group.max_turns)
        for turn in range(turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            t0 = time.perf_counter()
            await self._generate(active, prompt_ids, sampling, worker_id, tools)
            gen_s += time.perf_counter() - t0
            if turn == turns - 1 and generated is not None:  # every episode ends at this Step
                await generated()
                generated = None
            t1 = time.perf_counter()
            await self._step_environment(group, active, len(prompt_ids), tools)
            env_s += time.perf_counter() - t1
        if generated is not None:
            await generated()
        for e in episodes:
            e.done = True
        scale = group.reward_scale or 1.0
        completions = [types_pb2.Completion(
            token_ids=e.token_ids, generated_mask=e.generated_mask, generation_logprobs=e.logprobs,
            version_start=e.version_start, version_end=e.version_end, reward=e.reward * scale,
            named_rewards={k: v * scale for k, v in e.named_rewards.items()}, text=e.text,
            truncated=e.truncated, turns=e.turns, answer=e.answer, flaws=e.flaws if any(e.flaws) else [],
            messages=[message_from_dict(m) for m in e.messages[len(prompt):]] if with_messages else [])
            for e in episodes]
        return types_pb2.TrajectoryGroup(
            group_id=group.group_id, prompt_id=group.prompt_id, env_name=group.env_name,
            target_step=group.target_step, prompt_token_ids=prompt_ids, completions=completions,
            version_start=min(e.version_start for e in episodes), generation_seconds=gen_s,
            environment_seconds=env_s, worker_id=worker_id, leased_at_unix_ns=group.leased_at_unix_ns,
            finished_at_unix_ns=time.time_ns())

    async def _generate(self, active: list[EpisodeState], prompt_ids: list[int], sampling: Sampling,
                        worker_id: str, tools: list[dict] | None) -> None:
        inputs = [prompt_ids + e.token_ids for e in active]
        by_stops: dict[tuple[str, ...], list[int]] = {}
        for i, e in enumerate(active):  # episodes may ask for different stop strings
            by_stops.setdefault(tuple(e.stop_strings), []).append(i)
        for stops, idx in by_stops.items():
            turn = Sampling(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k, stop_strings=list(stops),
                            stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed)
            attributes = {"flywheel.worker": worker_id, "flywheel.version": self.engine.version,
                          "flywheel.prompts": len(idx)}
            with tracer.start_as_current_span("rollout.generate", attributes=attributes) as span:
                outs = await self.engine.generate([inputs[i] for i in idx], turn)
                _record_generation(span, outs, self.engine.version)
            for i, out in zip(idx, outs):
                e = active[i]
                # An empty turn (no room left) was sampled by no version: it takes the one loaded now.
                start, end = (out.version_start, out.version_end) if out.token_ids else (self.engine.version,) * 2
                if e.version_start < 0:
                    e.version_start = start
                e.version_end = max(e.version_end, end)
                message, flaws = self._assistant(out.text, tools)
                e.append(out.token_ids, out.logprobs, flaws)
                e.messages.append(message)
                e.text += out.text
                e.truncated |= out.truncated
                e.turns += 1

    def _assistant(self, text: str, tools: list[dict] | None) -> tuple[dict, int]:
        """The assistant message of a generated turn (its reasoning apart with a reasoning parser, the calls the tool
        parser reads when tools are offered), and the turn's TurnFlaw bits (flaws.py)."""
        turn = read_turn(text, self.generation, tokenizer=self.engine.tokenizer, tools=tools)
        message = {"role": "assistant", "content": turn.content or ""}
        if turn.reasoning:
            message["reasoning"] = turn.reasoning
        if turn.calls:
            TOOL_CALLS.inc(len(turn.calls))
            message["tool_calls"] = turn.calls
        return message, turn.flaws

    async def _step_environment(self, group: types_pb2.PromptGroup, active: list[EpisodeState], prompt_len: int,
                                tools: list[dict] | None) -> None:
        results = await self.steps.step(group.env_name, [
            environment_pb2.Episode(messages=[message_from_dict(m) for m in e.messages],
                                    metadata=e.metadata) for e in active])
        for e, r in zip(active, results, strict=True):
            e.reward += r.reward
            for k, v in r.named_rewards.items():
                e.named_rewards[k] = e.named_rewards.get(k, 0.0) + v
            e.answer = r.answer or e.answer
            if r.terminated or e.turns >= max(1, group.max_turns):
                e.done = True
                continue
            obs_ids = self._observation(e, r, tools)
            if obs_ids is None:
                continue
            room = self.max_seq_len - prompt_len - len(e.token_ids)
            if len(obs_ids) >= room:  # no room for another turn: the episode ends truncated
                e.truncated, e.done = True, True
                continue
            e.append(obs_ids, None)
            if r.next_stop_strings:
                e.stop_strings = list(r.next_stop_strings)
            if r.HasField("metadata"):
                e.metadata = r.metadata

    def _observation(self, e: EpisodeState, r: environment_pb2.EpisodeResult, tools: list[dict] | None
                     ) -> list[int] | None:
        """The observation's tokens, its messages appended to the episode's conversation. Messages (tool results)
        are tokenized as the chat template writes them after the conversation so far; a plain observation raw.
        None (the episode ends truncated) when the template rewrites earlier turns."""
        tok = self.engine.tokenizer
        if not r.observations:
            e.messages.append({"role": r.observation.role or "environment", "content": r.observation.content})
            return tok(r.observation.content, add_special_tokens=False).input_ids
        observations = [message_to_dict(m) for m in r.observations]
        try:
            text = observation_text(tok, e.messages, observations, tools)
        except TemplateDrift as err:
            TEMPLATE_DRIFT.inc()
            _warn.warning("drift", "episode ended: %s", err)
            e.truncated = e.done = True
            return None
        e.messages += observations
        return tok(text, add_special_tokens=False).input_ids


def _record_generation(span: trace.Span, outs: list[Generated], version_end: int) -> None:
    """Attributes of one engine call: tokens, time to first token (where the engine knows it), versions."""
    span.set_attribute("flywheel.tokens", sum(len(o.token_ids) for o in outs))
    span.set_attribute("flywheel.version_end", version_end)
    ttft = [o.first_token_s for o in outs if o.first_token_s is not None]
    if ttft:
        span.set_attribute("flywheel.ttft_s", min(ttft))
        TTFT_SECONDS.observe(min(ttft))

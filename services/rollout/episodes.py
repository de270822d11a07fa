"""The multi-turn loop: sample G episodes of one prompt, step the environment each turn.

Per turn, the active episodes are generated in one batch, then scored in one batched
EnvironmentService.Step, shared with the groups that score at the same moment (`StepBatcher`).
The observation is appended as tokens with loss mask 0 (tokenized raw, as NeMo RL does) unless
the episode ended. Each episode records the versions that produced its first and last generated token,
as the engine reports them per token (they differ only when weights were swapped in flight). Each
engine call is a `rollout.generate` span of the group's trace (time to first token, tokens, version,
worker); docs/observability.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import struct_pb2
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.logs import RateLimitedLog
from services.common.server import RETRIED
from services.rollout.engines import Engine, Generated, Sampling

tracer = trace.get_tracer("flywheel.rollout")
log = logging.getLogger("flywheel.rollout")
_warn = RateLimitedLog(log)
PROMPTS_TOO_LONG = Counter("flywheel_rollout_prompts_too_long_total",
                           "Prompt groups kept out of the loss: the prompt reached data.max_input_seq_length tokens")
KEPT_PROMPT_TOKENS = 4
"""A prompt kept out of the loss travels with its first few tokens only (NeMo RL's processors keep up to 4 per
message): the trainer still gets the group, and never a row of an unbounded prompt."""
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
    reward: float = 0.0
    named_rewards: dict[str, float] = field(default_factory=dict)
    text: str = ""
    answer: str = ""
    truncated: bool = False
    turns: int = 0
    done: bool = False
    version_start: int = -1
    version_end: int = -1

    def append(self, tokens: list[int], logprobs: list[float] | None) -> None:
        self.token_ids += tokens
        self.generated_mask += [logprobs is not None] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


class EpisodeRunner:
    """Runs one PromptGroup to a TrajectoryGroup with an engine and an environment stub."""

    def __init__(self, engine: Engine, env: environment_pb2_grpc.EnvironmentServiceStub, *,
                 default_sampling, max_seq_len: int, step_timeout_s: float, max_prompt_len: int | None = None) -> None:
        self.engine = engine
        self.steps = StepBatcher(env, step_timeout_s)
        self.default_sampling = default_sampling
        self.max_seq_len = max_seq_len
        self.max_prompt_len = min(max_prompt_len or max_seq_len, max_seq_len)
        """data.max_input_seq_length: a prompt of this many tokens or more is kept out of the loss."""

    async def run(self, group: types_pb2.PromptGroup, worker_id: str,
                  generated: Callable[[], Awaitable[None]] | None = None) -> types_pb2.TrajectoryGroup:
        """`generated` is awaited once the group needs the engine no more: after its last possible turn is
        generated, before that turn's Step (or after the Step that ended every episode early). The worker
        gives the group's engine slot to the next group there, so scoring and publishing overlap generation."""
        tok = self.engine.tokenizer
        prompt = [{"role": m.role, "content": m.content} for m in group.messages]
        # Off the event loop: a prompt of megabytes takes seconds to tokenize, and the worker's heartbeats, work queue
        # and rpcs must not wait for it.
        prompt_ids = await asyncio.to_thread(prompt_token_ids, tok, prompt)
        sampling = Sampling.resolve(self.default_sampling, group.sampling)
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
            await self._generate(active, prompt_ids, sampling, worker_id)
            gen_s += time.perf_counter() - t0
            if turn == turns - 1 and generated is not None:  # every episode ends at this Step
                await generated()
                generated = None
            t1 = time.perf_counter()
            await self._step_environment(group, active, len(prompt_ids))
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
            truncated=e.truncated, turns=e.turns, answer=e.answer) for e in episodes]
        return types_pb2.TrajectoryGroup(
            group_id=group.group_id, prompt_id=group.prompt_id, env_name=group.env_name,
            target_step=group.target_step, prompt_token_ids=prompt_ids, completions=completions,
            version_start=min(e.version_start for e in episodes), generation_seconds=gen_s,
            environment_seconds=env_s, worker_id=worker_id, leased_at_unix_ns=group.leased_at_unix_ns,
            finished_at_unix_ns=time.time_ns())

    async def _generate(self, active: list[EpisodeState], prompt_ids: list[int], sampling: Sampling,
                        worker_id: str) -> None:
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
                e.append(out.token_ids, out.logprobs)
                e.messages.append({"role": "assistant", "content": out.text})
                e.text += out.text
                e.truncated |= out.truncated
                e.turns += 1

    async def _step_environment(self, group: types_pb2.PromptGroup, active: list[EpisodeState], prompt_len: int) -> None:
        results = await self.steps.step(group.env_name, [
            environment_pb2.Episode(messages=[types_pb2.ChatMessage(**m) for m in e.messages],
                                    metadata=e.metadata) for e in active])
        tok = self.engine.tokenizer
        for e, r in zip(active, results, strict=True):
            e.reward += r.reward
            for k, v in r.named_rewards.items():
                e.named_rewards[k] = e.named_rewards.get(k, 0.0) + v
            e.answer = r.answer or e.answer
            if r.terminated or e.turns >= max(1, group.max_turns):
                e.done = True
                continue
            obs = r.observation.content
            e.messages.append({"role": r.observation.role or "environment", "content": obs})
            obs_ids = tok(obs, add_special_tokens=False).input_ids
            room = self.max_seq_len - prompt_len - len(e.token_ids)
            if len(obs_ids) >= room:  # no room for another turn: the episode ends truncated
                e.truncated, e.done = True, True
                continue
            e.append(obs_ids, None)
            if r.next_stop_strings:
                e.stop_strings = list(r.next_stop_strings)
            if r.HasField("metadata"):
                e.metadata = r.metadata


MERGED_REQUEST_BYTES = 8 << 20
"""A merged StepRequest stays under it (a group's own call may be larger): merging saves a round trip per
call, which counts for small calls, and large ones stay far below the servers' `security.max_message_mb`."""


class StepBatcher:
    """One Step rpc for the groups that score together.

    The groups of one engine batch come out of the engine at once and each then scores its episodes. The calls
    made in the same turn of the event loop for the same environment go as one StepRequest (up to
    `max_request_bytes`), and each caller gets its own episodes' results: one round trip and one dispatch in the
    environment service instead of one per group (on loopback, 4 calls of 16 toy episodes at once took 1.7 ms,
    one call of 64 took 1.0 ms). Nothing waits to fill a batch: a call alone goes alone. When a merged call is
    refused for its content (a code that no retry helps), each caller's episodes are sent again on their own,
    so one group's bad episode fails only that group.

    Each call is a `rollout.step` span of its group's trace. A merged rpc goes from its first caller's span, so
    the environment's own span is in that group's trace; the `rollout.step` spans of one rpc link to each other.
    """

    def __init__(self, env: environment_pb2_grpc.EnvironmentServiceStub, timeout_s: float, *,
                 max_request_bytes: int = MERGED_REQUEST_BYTES) -> None:
        self.env = env
        self.timeout_s = timeout_s
        self.max_request_bytes = max_request_bytes
        self._calls: dict[str, list[_Call]] = {}
        self._sending: set[asyncio.Task] = set()

    async def step(self, env_name: str, episodes: list[environment_pb2.Episode]) -> list[environment_pb2.EpisodeResult]:
        with tracer.start_as_current_span("rollout.step", attributes={
                "flywheel.env": env_name, "flywheel.episodes": len(episodes)}) as span:
            call = _Call(episodes, sum(e.ByteSize() for e in episodes), asyncio.get_running_loop().create_future(),
                         span, contextvars.copy_context())
            calls = self._calls.get(env_name)
            if calls is None:  # the first call of this turn: the send runs once the turn's other calls have joined
                calls = self._calls[env_name] = []
                asyncio.get_running_loop().call_soon(self._send_soon, env_name)
            calls.append(call)
            return await call.future

    def _send_soon(self, env_name: str) -> None:
        for calls in _fill(self._calls.pop(env_name), self.max_request_bytes):
            task = asyncio.create_task(self._send(env_name, calls), context=calls[0].context)  # its span's child
            self._sending.add(task)  # held until done: the loop keeps only a weak reference to a task
            task.add_done_callback(self._sending.discard)

    async def _send(self, env_name: str, calls: list[_Call]) -> None:
        first = calls[0]
        first.span.set_attribute("flywheel.groups", len(calls))
        for call in calls[1:]:
            first.span.add_link(call.span.get_span_context())
            call.span.add_link(first.span.get_span_context())
        if len(calls) == 1:
            await self._send_alone(env_name, first)
            return
        try:
            results = await self._call(env_name, [e for call in calls for e in call.episodes])
        except grpc.aio.AioRpcError as err:
            if err.code() in RETRIED:
                _fail(calls, err)
            else:  # refused for its content, perhaps one group's: each group on its own finds out which
                await asyncio.gather(*(self._send_alone(env_name, call) for call in calls))
            return
        except Exception as err:  # noqa: BLE001 - every caller of the merged call gets it
            _fail(calls, err)
            return
        start = 0
        for call in calls:
            if not call.future.done():  # a caller that stopped waiting (cancelled) loses nothing by this
                call.future.set_result(results[start:start + len(call.episodes)])
            start += len(call.episodes)

    async def _send_alone(self, env_name: str, call: _Call) -> None:
        try:
            results = await self._call(env_name, call.episodes)
        except Exception as err:  # noqa: BLE001 - the caller gets it
            _fail([call], err)
            return
        if not call.future.done():
            call.future.set_result(results)

    async def _call(self, env_name: str, episodes: list[environment_pb2.Episode]) -> list[environment_pb2.EpisodeResult]:
        request = environment_pb2.StepRequest(env_name=env_name, episodes=episodes)
        response = await self.env.Step(request, timeout=self.timeout_s, wait_for_ready=True)
        if len(response.results) != len(episodes):
            raise ValueError(f"environment {env_name!r} returned {len(response.results)} results for "
                             f"{len(episodes)} episodes")
        return list(response.results)


@dataclass(slots=True)
class _Call:
    episodes: list[environment_pb2.Episode]
    nbytes: int
    future: asyncio.Future
    span: trace.Span
    context: contextvars.Context
    """The caller's, inside its span: the rpc that this call starts is sent in it."""


def _fill(calls: list[_Call], max_bytes: int) -> list[list[_Call]]:
    """The calls in order, cut into requests of at most `max_bytes` (a call larger than that alone)."""
    requests: list[list[_Call]] = []
    size = 0
    for call in calls:
        if not requests or size + call.nbytes > max_bytes:
            requests.append([])
            size = 0
        requests[-1].append(call)
        size += call.nbytes
    return requests


def _fail(calls: list[_Call], err: BaseException) -> None:
    for call in calls:
        if not call.future.done():
            call.future.set_exception(err)


def _record_generation(span: trace.Span, outs: list[Generated], version_end: int) -> None:
    """Attributes of one engine call: tokens, time to first token (where the engine knows it), versions."""
    span.set_attribute("flywheel.tokens", sum(len(o.token_ids) for o in outs))
    span.set_attribute("flywheel.version_end", version_end)
    ttft = [o.first_token_s for o in outs if o.first_token_s is not None]
    if ttft:
        span.set_attribute("flywheel.ttft_s", min(ttft))
        TTFT_SECONDS.observe(min(ttft))

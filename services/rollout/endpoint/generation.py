"""One endpoint call through the engine: limits, sampling, the span, the metrics and the recording.

The request's sampling is honoured (unset fields take the episode's environment's `sampling`, then
policy.generation's values, as the built-in episode loop's turns take them); the trainer scores every
sample under policy.generation.temperature, so an agent in training should leave temperature unset.
Temperature 0 is greedy: top_k 1, logprobs under T = 1. max_tokens defaults to
policy.generation.max_new_tokens and is cut to the room the sequence limit leaves; a prompt with no room left
is refused (context_length_exceeded).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from services.common.config import GenerationConfig
from services.rollout.endpoint.errors import ApiError, bad_request, context_length_exceeded
from services.rollout.endpoint.recording import Turn
from services.rollout.endpoint.schemas import Sampled
from services.rollout.endpoint.sessions import Episode
from services.rollout.endpoint.trajectory import Call, Choice
from services.rollout.engines import Engine, Generated, Sampling

tracer = trace.get_tracer("flywheel.rollout")
CALLS = Counter("flywheel_endpoint_calls_total", "Endpoint calls answered, by route and HTTP status",
                ["route", "status"])
PROMPT_TOKENS = Counter("flywheel_endpoint_prompt_tokens_total", "Prompt tokens of answered endpoint calls")
COMPLETION_TOKENS = Counter("flywheel_endpoint_completion_tokens_total",
                            "Tokens generated for endpoint calls")
CALL_SECONDS = Histogram("flywheel_endpoint_call_seconds", "Endpoint call latency (request to answer)",
                         ["route"],
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


@dataclass(kw_only=True, slots=True)
class Result:
    prompt_ids: list[int]
    outs: list[Generated]


def with_environment(default: GenerationConfig, o) -> GenerationConfig:
    """policy.generation with an environment's SamplingParams `o` over it (zero or empty: the default's)."""
    return default.model_copy(update={k: v for k, v in dict(
        max_new_tokens=o.max_new_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
        stop_strings=list(o.stop_strings)).items() if v})


def sampling(request: Sampled, budget: int | None, default: GenerationConfig, room: int) -> Sampling:
    temperature = default.temperature if request.temperature is None else request.temperature
    top_k = request.top_k if request.top_k not in (None, -1, 0) else default.top_k
    if temperature == 0:
        temperature, top_k = 1.0, 1
    return Sampling(max_new_tokens=min(budget or default.max_new_tokens, room), temperature=temperature,
                    top_p=default.top_p if request.top_p is None else request.top_p, top_k=top_k,
                    stop_strings=(request.stop_strings() if request.stop is not None
                                  else list(default.stop_strings)),
                    stop_token_ids=list(default.stop_token_ids or []), seed=request.seed)


class Generator:
    def __init__(self, engine: Engine, default: GenerationConfig, worker_id: str) -> None:
        self.engine, self.default, self.worker_id = engine, default, worker_id
        self.tracer = tracer

    async def generate(self, episode: Episode, route: str, prompt_ids: list[int], request: Sampled,
                       budget: int | None, n: int) -> Result:
        """`n` choices of `prompt_ids` (record them with `record`)."""
        self.check(episode, prompt_ids)
        limit = episode.limits.max_sequence_tokens
        episode.calls += 1
        params = sampling(request, budget, episode.sampling or self.default, limit - len(prompt_ids))
        if params.stop_strings:
            await asyncio.to_thread(check_stop_strings, self.engine.tokenizer, params.stop_strings)
        attributes = {"flywheel.worker": self.worker_id, "flywheel.route": route,
                      "flywheel.session": episode.key,
                      "flywheel.prompt_tokens": len(prompt_ids), "flywheel.choices": n}
        with self.tracer.start_as_current_span("rollout.endpoint", context=episode.context,
                                               attributes=attributes) as span:
            outs = await self.engine.generate([prompt_ids] * n, params)
            span.set_attribute("flywheel.tokens", sum(len(o.token_ids) for o in outs))
            span.set_attribute("flywheel.version_end", self.engine.version)
        if episode.closed:
            raise ApiError(410, "the episode finished while this call ran: its answer is not recorded",
                           code="episode_finished")
        PROMPT_TOKENS.inc(len(prompt_ids))
        COMPLETION_TOKENS.inc(sum(len(o.token_ids) for o in outs))
        return Result(prompt_ids=prompt_ids, outs=outs)

    def check(self, episode: Episode, prompt_ids: list[int]) -> None:
        """Refuse a prompt the episode cannot take: empty, no room left, ids out of the vocabulary, or past the
        episode's calls."""
        limit = episode.limits.max_sequence_tokens
        if not prompt_ids:
            raise bad_request("the prompt has no tokens", param="prompt")
        if len(prompt_ids) >= limit:
            raise context_length_exceeded(len(prompt_ids), limit)
        if episode.calls >= episode.limits.max_calls:
            raise ApiError(429, f"this episode made its {episode.limits.max_calls} calls",
                           code="episode_call_limit")
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise bad_request(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")

    def record(self, episode: Episode, result: Result, turns: list[Turn] = (), flaws: list[int] = (),
               conversation: list[dict] | None = None) -> None:
        """`flaws`: each choice's TurnFlaw bits (services/rollout/flaws.py); none given, none found."""
        flaws = list(flaws) or [0] * len(result.outs)
        choices = [Choice(token_ids=o.token_ids, logprobs=o.logprobs, truncated=o.truncated, flaws=f,
                          versions=list(o.versions) or [self.engine.version] * len(o.token_ids))
                   for o, f in zip(result.outs, flaws, strict=True)]
        episode.recording.record(Call(prompt_ids=result.prompt_ids, choices=choices), list(turns), conversation)


def check_stop_strings(tokenizer, stop_strings: list[str]) -> None:
    """transformers refuses stop strings that no token sequence can end (they could never match)."""
    from transformers import StopStringCriteria

    try:
        StopStringCriteria(tokenizer, stop_strings)
    except ValueError as err:
        raise bad_request(f"stop: {err}"[:512], param="stop") from None


def observe(route: str, status: int, started: float) -> None:
    CALLS.labels(route, str(status)).inc()
    CALL_SECONDS.labels(route).observe(time.perf_counter() - started)

"""Validation (every grpo.val_period steps, at start, at end) and `flywheel eval`: the same code.

    validation prompts ──Generate(n = val_num_generations_per_prompt, env_name)──▶ rollout (weights loaded now)
        ──▶ the training's episode loop (generation, environment turns) ──rewards──▶ accuracy, avg length, pass@k

The prompts are data.validation's (and split_validation_size hold-outs), or, without those, grpo.max_val_samples
that each environment of the config's `environments` list generates, from a seed apart from training's (NeMo RL's
sliding-puzzle example validates on generated puzzles). Each keeps its environment's max_turns and sampling.

Metric names are NeMo RL's: validation/accuracy (mean reward over every sample), validation/avg_length
(generated tokens, observations not counted), validation/pass@k with k = n, by the unbiased estimator of
Chen et al. (2021) averaged over prompts. A sample counts as correct when its reward is > 0, as NeMo RL's pass rate does.

A prompt whose agent episode failed every attempt rollout gives it (FAILED_PRECONDITION, or the call's deadline)
costs that prompt, not the validation: it is left out of the metrics and counted in validation/failed_prompts,
with its error kept in its PromptResult. Only when every prompt failed does the validation fail, with the first
error. Any other error (rollout or environment unreachable, a prompt refused) fails it at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import rollout_pb2, types_pb2

log = logging.getLogger("flywheel.controller.evaluation")
CONCURRENCY = 8
"""Validation prompts in flight at once."""
PROMPT_FAILURES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)
"""Generate's answers that fail one prompt (its agent failed every attempt, or outlasted the call)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c of n correct.

    1 - C(n-c, k) / C(n, k), as the product 1 - prod_{i=n-c+1..n} (1 - k/i): no big binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


@dataclass(kw_only=True, slots=True)
class PromptResult:
    prompt: str
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    version: int = -1
    """Policy version that generated these samples (the lowest, if weights changed in between)."""
    completions: list = field(default_factory=list)
    """The Completion messages Generate answered, with each episode's messages (`flywheel collect` writes them)."""
    error: str = ""
    """Why Generate failed this prompt (PROMPT_FAILURES); it then has no samples."""


def summarize(results: list[PromptResult], k: int) -> dict[str, float]:
    """NeMo RL's validation metrics over the prompts that were scored; failed ones only counted."""
    failed = [p for p in results if p.error]
    results = [p for p in results if not p.error]
    if not results:
        raise RuntimeError(f"every one of {len(failed)} validation prompts failed; the first: {failed[0].error}")
    rewards = [r for p in results for r in p.rewards]
    lengths = [n for p in results for n in p.lengths]
    return {
        "validation/accuracy": sum(rewards) / len(rewards),
        "validation/avg_length": sum(lengths) / len(lengths),
        f"validation/pass@{k}": sum(pass_at_k(len(p.rewards), sum(r > 0 for r in p.rewards), k)
                                    for p in results) / len(results),
        "validation/num_prompts": float(len(results)),
        "validation/policy_version": float(min(p.version for p in results)),
        "validation/failed_prompts": float(len(failed)),
    }


VALIDATION_SEED = 1 << 32
"""Added to run.seed for the prompts an environment generates for validation: a stream apart from training's."""
GENERATED_UNBOUNDED = 256
"""Generated validation prompts when grpo.max_val_samples is null ("all"), which a generator does not have."""


class Validator:
    """Scores a fixed prompt set with the weights rollout serves now."""

    def __init__(self, prompts: list[types_pb2.PromptGroup], rollout, *, n: int) -> None:
        self.prompts = prompts
        """Each prompt with its environment, first-turn metadata, max_turns and sampling."""
        self.rollout = rollout
        self.n = n

    async def run(self) -> tuple[dict[str, float], list[PromptResult]]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(prompt: types_pb2.PromptGroup) -> PromptResult:
            async with gate:
                return await self._one(prompt)

        results = await asyncio.gather(*(one(p) for p in self.prompts))
        return summarize(results, self.n), results

    async def _one(self, prompt: types_pb2.PromptGroup) -> PromptResult:
        try:
            generated = await self.rollout.Generate(rollout_pb2.GenerateRequest(
                messages=prompt.messages, tools=prompt.tools, n=self.n, sampling=prompt.sampling,
                env_name=prompt.env_name, metadata=prompt.metadata, max_turns=prompt.max_turns),
                timeout=600, wait_for_ready=True)
        except grpc.aio.AioRpcError as err:
            if err.code() not in PROMPT_FAILURES:
                raise
            log.warning("validation prompt %r failed: %s", prompt.messages[-1].content[-80:], err.details())
            return PromptResult(prompt=prompt.messages[-1].content, error=f"{err.code().name}: {err.details()}")
        completions = list(generated.completions)
        return PromptResult(prompt=prompt.messages[-1].content, rewards=[c.reward for c in completions],
                            lengths=[sum(c.generated_mask) for c in completions], texts=[c.text for c in completions],
                            version=min(c.version_start for c in completions), completions=completions)


async def generated_prompts(cfg: FlywheelConfig, registry) -> list[types_pb2.PromptGroup]:
    """grpo.max_val_samples prompts (GENERATED_UNBOUNDED when null) shared among cfg.generating_environments,
    registered in `registry`, each drawn from run.seed + VALIDATION_SEED."""
    names, total = cfg.generating_environments, cfg.grpo.max_val_samples or GENERATED_UNBOUNDED
    prompts = []
    for i, name in enumerate(names):
        count = total // len(names) + (i < total % len(names))
        if count:
            prompts += await registry.generated(name, count, cfg.run.seed + VALIDATION_SEED)
    return prompts


def validation_prompts(cfg: FlywheelConfig, sets) -> list[types_pb2.PromptGroup]:
    """The first grpo.max_val_samples prompts of the validation sets, in order."""
    prompts = [types_pb2.PromptGroup(env_name=s.env_name, messages=row.messages, tools=row.tools,
                                     metadata=row.metadata, max_turns=cfg.grpo.max_rollout_turns) for s in sets for row in s.rows]
    limit = cfg.grpo.max_val_samples
    return prompts if limit is None else prompts[:limit]


def sample_lines(results: list[PromptResult], count: int) -> list[str]:
    """logger.num_val_samples_to_print samples, as lines for the log."""
    out = []
    for p in [p for p in results if not p.error][:count]:
        out.append(f"prompt: {p.prompt[-200:]!r}\n  response: {p.texts[0][:300]!r}\n  reward: {p.rewards[0]:g}")
    return out


class ValidationLoop:
    """Runs requested validations one at a time in the background; results go to the tracker, the run's state
    bucket (checkpoints are ranked by them), <run_dir>/validation.jsonl and (logger.num_val_samples_to_print
    samples) the log."""

    def __init__(self, cfg: FlywheelConfig, validator: Validator, tracker, state=None) -> None:
        self.cfg = cfg
        self.validator = validator
        self.tracker = tracker
        self.state = state
        """The run's StateStore: each validation's metrics go there for the trainer's checkpoint ranking."""
        self.done: set[int] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def request(self, version: int) -> None:
        """Run a validation of `version` in the background, once; saved as requested first, so that a controller
        killed before it is done runs it when it starts again (`resume`)."""
        if version in self.done:
            return
        self.done.add(version)
        if self.state is not None:
            await self.state.save_validating(version)
        task = asyncio.create_task(self._run(version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def resume(self) -> None:
        """The validations a killed controller requested and did not finish, now, with the weights rollout serves
        now (validation/policy_version says which)."""
        if self.state is not None:
            for version in await self.state.load_validating():
                log.info("validation of version %d was requested before the controller stopped: running it", version)
                await self.request(version)

    async def _run(self, version: int) -> None:
        try:
            await self._validate(version)
        finally:
            if self.state is not None:
                await self.state.forget_validating(version)

    async def _validate(self, version: int) -> None:
        async with self._lock:
            try:
                metrics, results = await self.validator.run()
            except Exception:  # a failed validation is logged; training goes on
                log.exception("validation of version %d failed", version)
                return
        self.tracker.log(metrics, version)
        with (Path(self.cfg.run.run_dir or ".") / "validation.jsonl").open("a") as f:
            f.write(json.dumps({"version": version, **metrics}) + "\n")
        if self.state is not None:
            try:
                await self.state.save_validated(version, metrics)
            except Exception:  # the checkpoint it would rank then counts as not validated
                log.exception("validation of version %d: its metrics did not reach the run's state bucket", version)
        log.info("validation v%d: %s", version, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        for line in sample_lines(results, self.cfg.logger.num_val_samples_to_print):
            log.info("validation sample v%d: %s", version, line)

    async def drain(self) -> None:
        """Waits for the validations already requested (the run's last one before shutdown)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

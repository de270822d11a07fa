"""Validation (every grpo.val_period steps, at start, at end) and `flywheel eval`: the same code.

    validation prompts ──Generate(n = val_num_generations_per_prompt)──▶ rollout (weights loaded now)
        completions ──Step(prompt + answer)──▶ environment ──rewards──▶ accuracy, avg length, pass@k

Metric names are NeMo RL's: validation/accuracy (mean reward over every sample), validation/avg_length
(generated tokens), validation/pass@k with k = n, by the unbiased estimator of Chen et al. (2021)
averaged over prompts. A sample counts as correct when its reward is > 0, as NeMo RL's pass rate does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import FlywheelConfig
from services.common.pb.flywheel.v1 import environment_pb2, rollout_pb2, types_pb2

log = logging.getLogger("flywheel.controller.evaluation")
CONCURRENCY = 8
"""Validation prompts in flight at once."""


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


def summarize(results: list[PromptResult], k: int) -> dict[str, float]:
    rewards = [r for p in results for r in p.rewards]
    lengths = [n for p in results for n in p.lengths]
    return {
        "validation/accuracy": sum(rewards) / len(rewards),
        "validation/avg_length": sum(lengths) / len(lengths),
        f"validation/pass@{k}": sum(pass_at_k(len(p.rewards), sum(r > 0 for r in p.rewards), k)
                                    for p in results) / len(results),
        "validation/num_prompts": float(len(results)),
        "validation/policy_version": float(min(p.version for p in results)),
    }


def due(cfg: FlywheelConfig, version: int, final: bool) -> bool:
    """Validate the weights of `version` (= steps done)? NeMo RL's val_period / val_start_at / val_at_* rules."""
    g = cfg.grpo
    if version == 0:
        return g.val_at_start
    periodic = g.val_period > 0 and version % g.val_period == 0 and version >= g.val_start_at
    return periodic or (final and g.val_at_end)


class Validator:
    """Scores a fixed prompt set with the weights rollout serves now."""

    def __init__(self, prompts: list[tuple[str, types_pb2.DatasetRow]], rollout, environment, *, n: int,
                 sampling: types_pb2.SamplingParams | None = None) -> None:
        self.prompts = prompts
        """(environment name, row) pairs."""
        self.rollout = rollout
        self.environment = environment
        self.n = n
        self.sampling = sampling or types_pb2.SamplingParams()

    async def run(self) -> tuple[dict[str, float], list[PromptResult]]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(env_name: str, row: types_pb2.DatasetRow) -> PromptResult:
            async with gate:
                return await self._one(env_name, row)

        results = await asyncio.gather(*(one(e, r) for e, r in self.prompts))
        return summarize(results, self.n), results

    async def _one(self, env_name: str, row: types_pb2.DatasetRow) -> PromptResult:
        generated = await self.rollout.Generate(rollout_pb2.GenerateRequest(
            messages=row.messages, n=self.n, sampling=self.sampling), timeout=600, wait_for_ready=True)
        episodes = [environment_pb2.Episode(
            messages=[*row.messages, types_pb2.ChatMessage(role="assistant", content=c.text)],
            metadata=row.metadata) for c in generated.completions]
        scored = await self.environment.Step(environment_pb2.StepRequest(env_name=env_name, episodes=episodes),
                                             timeout=120, wait_for_ready=True)
        completions = list(generated.completions)
        return PromptResult(prompt=row.messages[-1].content, rewards=[r.reward for r in scored.results],
                            lengths=[len(c.token_ids) for c in completions], texts=[c.text for c in completions],
                            version=min(c.version_start for c in completions))


def validation_prompts(cfg: FlywheelConfig, sets) -> list[tuple[str, types_pb2.DatasetRow]]:
    """The first grpo.max_val_samples prompts of the validation sets, in order."""
    prompts = [(s.env_name, row) for s in sets for row in s.rows]
    limit = cfg.grpo.max_val_samples
    return prompts if limit is None else prompts[:limit]


def sample_lines(results: list[PromptResult], count: int) -> list[str]:
    """logger.num_val_samples_to_print samples, as lines for the log."""
    out = []
    for p in results[:count]:
        out.append(f"prompt: {p.prompt[-200:]!r}\n  response: {p.texts[0][:300]!r}\n  reward: {p.rewards[0]:g}")
    return out


class ValidationLoop:
    """Runs requested validations one at a time in the background; results go to the tracker,
    <run_dir>/validation.jsonl and (logger.num_val_samples_to_print samples) the log."""

    def __init__(self, cfg: FlywheelConfig, validator: Validator, tracker) -> None:
        self.cfg = cfg
        self.validator = validator
        self.tracker = tracker
        self.done: set[int] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    def request(self, version: int) -> None:
        if version in self.done:
            return
        self.done.add(version)
        task = asyncio.create_task(self._run(version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, version: int) -> None:
        async with self._lock:
            try:
                metrics, results = await self.validator.run()
            except Exception:  # a failed validation is logged; training goes on
                log.exception("validation of version %d failed", version)
                return
        self.tracker.log(metrics, version)
        with (Path(self.cfg.run.run_dir or ".") / "validation.jsonl").open("a") as f:
            f.write(json.dumps({"version": version, **metrics}) + "\n")
        log.info("validation v%d: %s", version, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        for line in sample_lines(results, self.cfg.logger.num_val_samples_to_print):
            log.info("validation sample v%d: %s", version, line)

    async def drain(self) -> None:
        """Waits for the validations already requested (the run's last one before shutdown)."""
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

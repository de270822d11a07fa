"""The rollout service with each engine, inside the whole system (real NATS, Redis, gRPC, one process per
service): logprob parity measured by the trainer itself, and weight updates reaching the engine every step.

With k = 0 every group is sampled by the weights the trainer is about to train, so the trainer's
token_mult_prob_error (generation logprobs from rollout vs its own prev_logprobs) measures only the engine's
numerics, step after step. A weight update that did not reach the engine would show as a larger error as
soon as the weights moved, and as a version tag behind the step.
"""

from __future__ import annotations

import asyncio

import pytest

from recorded import recorded_batches
from services.common.config import load_config
from services.local import LocalStack

STEPS = 8


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_engine_logprobs_match_the_trainers_every_step_and_every_group_is_tagged_with_its_step(tmp_path, backend):
    cfg = load_config(None, [f"policy.generation.backend={backend}", f"grpo.max_num_steps={STEPS}",
                             "grpo.async_grpo.enabled=false", "checkpointing.enabled=false",
                             "policy.generation.max_new_tokens=8"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)
        got = asyncio.run(recorded_batches(stack, STEPS))

    errors = [r["train/token_mult_prob_error"] for r in rows[:STEPS]]
    assert max(errors) <= 1.05, f"{backend}: token_mult_prob_error per step {errors}"
    assert rows[STEPS - 1]["train/grad_norm"] > 0  # the weights did move between the steps
    for step, batch in enumerate(got):
        for group in batch.groups:
            for c in group.completions:
                assert c.version_start == c.version_end == step, (step, c.version_start, c.version_end)
                assert len(c.generation_logprobs) == len(c.token_ids)
                assert all(lp <= 0 for lp, m in zip(c.generation_logprobs, c.generated_mask) if m)

"""A LoRA run end to end: the trainer trains adapters on the frozen base, rollout generates with the merged
weights, and the toy task is learnt.

Synchronous GRPO makes the check exact: each step's samples come from the weights the trainer computes its
logprobs with, so token_mult_prob_error stays at 1 only if rollout holds W + scale · B A. A rollout left
with the base weights (or a stale merge) drifts from it as soon as B moves off zero, at step 1.
"""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.local import LocalStack

STEPS = 60


@pytest.mark.slow
def test_a_lora_run_learns_the_toy_task_and_rollout_generates_with_the_merged_weights(tmp_path):
    cfg = load_config(None, [f"grpo.max_num_steps={STEPS}", "grpo.async_grpo.enabled=false",
                             "checkpointing.enabled=false", "policy.lora_cfg.enabled=true",
                             # the toy task needs lm_head adapted; kaiming A at this lr learns it in 60 steps
                             "policy.lora_cfg.match_all_linear=true", "policy.lora_cfg.lora_A_init=kaiming",
                             "policy.optimizer.kwargs.lr=0.002"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)

    errors = [r["train/token_mult_prob_error"] for r in rows]
    assert max(errors) < 1.001, errors
    first = sum(r["train/reward_mean"] for r in rows[:10]) / 10
    last = sum(r["train/reward_mean"] for r in rows[-10:]) / 10
    assert last >= 0.15 and last >= 2 * first, f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"

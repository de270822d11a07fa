"""The built-in tool task trains through `flywheel up`'s local stack: every service in its own process, the hf
backend, vLLM's hermes parser reading the tiny model's <tool_call> blocks, tool_add running the calls.

A random tiny model never writes a 70-character call, so the run starts from a briefly supervised model
(tests/tool_demos.py: demonstrations of right episodes, stopped while many sampled calls are still wrong).

It shows that tool episodes flow through every service and are trained on, scored by the tool's result (the
reward is 0 unless the parser reads the call and the environment's tool message comes back), that the recorded
generation logprobs of the two-turn episodes match the trainer's exactly (synchronous, k = 0), and that GRPO raises
the reward. The rise is modest and needs a gentle step: measured from this start (mean of the first -> last 10
steps), 60 steps of 8 prompts x 8 at lr 3e-4 went 0.40 -> 0.56; 30 steps of 4 x 8 stayed flat at lr 2e-4 (0.44 ->
0.44, first/last 5) and lr 5e-4 (0.44 -> 0.46); lr 1e-3 fell to 0 after one or two steps (k = 0 and k = 1). The
reward curve is printed (pytest -s).
"""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.local import LocalStack

pytestmark = pytest.mark.slow
STEPS = 60
RISE = 0.05
"""Last 10 steps' mean reward over the first 10's, at least. Measured: 0.40 -> 0.56 and 0.42 -> 0.57, and once,
with two test workers at a load of 9, 0.49 -> 0.56 (the first steps vary from run to run more than each step's
standard error of about 0.06 over 64 episodes says); for a run that does not learn, the difference of two 10-step
means has a standard error of about 0.03."""
PARITY = 1.05  # NeMo RL's bar on token_mult_prob_error


def test_the_tool_task_trains_on_the_recorded_tokens_and_its_reward_rises(tmp_path, tool_model):
    model = tool_model
    cfg = load_config(None, [
        f"policy.model_name={model}", "policy.max_total_sequence_length=256", "policy.generation.max_new_tokens=80",
        "policy.generation.tool_parser=hermes", "policy.train_micro_batch_size=64",
        "policy.optimizer.kwargs.lr=3e-4", "loss_fn.reference_policy_kl_penalty=0.0",
        "grpo.async_grpo.max_trajectory_age_steps=0", "environments=[{name: calc, kind: tool_add, max_turns: 2}]",
        f"grpo.max_num_steps={STEPS}", "grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=8",
        "checkpointing.enabled=false"])
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=1200)
    curve = [round(r["train/reward_mean"], 3) for r in rows]
    print("train/reward_mean per step:", curve)
    assert all(r > 0 for r in curve) and sum(curve) / len(curve) >= 0.2, curve  # calls read, run, and answered
    assert all(r["train/mean_gen_tokens_per_sample"] > 60 for r in rows)  # a call turn and an answer turn
    assert all(r["train/token_mult_prob_error"] <= PARITY for r in rows), [r["train/token_mult_prob_error"] for r in rows]
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    assert last >= first + RISE, f"reward did not rise: first 10 {first:.3f}, last 10 {last:.3f}"

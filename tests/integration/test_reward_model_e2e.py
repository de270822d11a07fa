"""NeMo RL's grpo_rm_1B.yaml (through `defaults:`) as a real job: a dataset the test makes, every episode scored by
the reward-model server (`flywheel serve reward_model`, which `flywheel up` starts), here the tiny random reward
model in place of Skywork-Reward-V2 (no model hub on this machine; the loading code is the same)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from services.common.config import load_config
from services.evaluate import run_eval
from services.local import LocalStack, read_restarts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NEMO_RM = ROOT / "tests/fixtures/nemo_rl/examples/configs/grpo_rm_1B.yaml"
STEPS = 4


def _write(tmp_path: Path) -> Path:
    rows = [{"problem": f"what is {a} + {b}?", "expected_answer": str(a + b)} for a in range(4) for b in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "rm.yaml"
    config.write_text(f"""defaults: {NEMO_RM}
grpo: {{num_prompts_per_step: 4, num_generations_per_prompt: 4, max_num_steps: {STEPS}}}
loss_fn: {{reference_policy_kl_penalty: 0.0}}
policy:
  model_name: tiny
  precision: float32
  max_total_sequence_length: 256
  train_global_batch_size: 16
  train_micro_batch_size: 16
  sequence_packing: {{enabled: false}}
  generation: {{backend: hf, max_new_tokens: 6, colocated: {{enabled: false}}}}
data:
  train: {{data_path: {tmp_path / 'train.jsonl'}, dataset_name: null, split_validation_size: 0}}
  default: {{prompt_file: {ROOT / 'tests/fixtures/nemo_rl/examples/prompts/cot.txt'}}}
env: {{reward_model: {{model_name: tiny, precision: float32}}}}
checkpointing: {{enabled: false}}
""")
    return config


def test_nemo_rl_reward_model_config_trains_on_the_reward_models_scores(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert cfg.uses_reward_model and [d.env_name for d in cfg.data.train_sets()] == ["reward_model"]
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)
        env_log = (tmp_path / "run" / "logs" / "environment.log").read_text()
    rewards = [r["train/reward_mean/reward_model"] for r in rows]
    # A failed call is logged and its groups handed back, never scored; the reward model's scores are real numbers,
    # a different mean for each step's different completions.
    assert "failed" not in env_log, env_log[-2000:]
    assert len(set(rewards)) == STEPS and all(r != 0.0 for r in rewards), rewards
    assert statistics.pstdev(rewards) > 0


def test_a_killed_reward_model_server_is_restarted_and_no_episode_is_scored_as_failed(tmp_path):
    """SIGKILL the reward-model server after the first step: the supervisor starts it again, and the environment
    service's calls wait for it (within env.reward_model.timeout_s) rather than scoring episodes 0."""
    cfg = load_config(_write(tmp_path), ["grpo.max_num_steps=8", "grpo.max_num_epochs=2"])
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        stack.wait_for(lambda rows: len(rows) >= 1, "1 step", timeout_s=600)
        first = stack.children.procs["reward_model"]
        first.kill()
        rows = stack.wait_for(lambda rows: len(rows) >= 8, "8 steps", timeout_s=900)
        restarted = stack.children.procs["reward_model"]
        env_log = (tmp_path / "run" / "logs" / "environment.log").read_text()
    assert restarted.pid != first.pid and [r["service"] for r in read_restarts(tmp_path / "run")] == ["reward_model"]
    assert "failed" not in env_log, env_log[-2000:]
    assert all(r["train/reward_mean/reward_model"] != 0.0 for r in rows)


def test_flywheel_eval_scores_with_the_reward_model_too(tmp_path):
    """`flywheel eval` starts the reward-model server as `flywheel up` does: accuracy is the mean score."""
    cfg = load_config(_write(tmp_path), [f"data.validation={{data_path: {tmp_path / 'train.jsonl'}}}",
                                         "grpo.max_val_samples=4", "grpo.val_num_generations_per_prompt=2"])
    metrics = run_eval(cfg, tmp_path / "eval")
    samples = [json.loads(line) for line in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    rewards = [r for s in samples for r in s["rewards"]]
    assert len(rewards) == 8 and len(set(rewards)) > 1 and 0.0 not in rewards  # scores, not failures
    assert metrics["validation/accuracy"] == pytest.approx(sum(rewards) / len(rewards))

"""NeMo RL's gdpo_math_1B.yaml as a real job: gsm8k-shaped rows the test writes, the math_multi_reward
environment's three reward components, GDPO advantages in the trainer."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from services.common.config import load_config
from services.local import LocalStack

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
GDPO = ROOT / "tests/fixtures/nemo_rl/examples/configs/gdpo_math_1B.yaml"
STEPS = 4
COMPONENTS = ("train/reward/correctness", "train/reward/format", "train/reward/integer")


def _write(tmp_path: Path) -> Path:
    rng = random.Random(0)
    rows = [{"question": f"{a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in ((rng.randint(0, 4), rng.randint(0, 4)) for _ in range(32))]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "system.txt").write_text("answer in <answer></answer>")
    config = tmp_path / "gdpo.yaml"
    config.write_text(f"""defaults: {GDPO}
grpo: {{num_prompts_per_step: 4, num_generations_per_prompt: 8, max_num_steps: {STEPS}, val_period: 0}}
loss_fn: {{reference_policy_kl_penalty: 0.0}}
policy:
  model_name: tiny
  max_total_sequence_length: 96
  train_global_batch_size: 32
  train_micro_batch_size: 32
  generation: {{backend: hf, max_new_tokens: 3, colocated: {{enabled: false}}}}
data:
  train: {{data_path: {tmp_path / 'gsm8k.jsonl'}}}
  validation: null
  default: {{system_prompt_file: {tmp_path / 'system.txt'}}}
env: {{math_multi_reward: {{num_workers: 1}}}}
logger: {{wandb_enabled: false}}  # the recipe logs to W&B, which needs an account and the network
checkpointing: {{enabled: false}}
""")
    return config


def test_gdpo_trains_on_the_multi_reward_components(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert cfg.grpo.adv_estimator.name == "gdpo" and cfg.data.train.env_name == "math_multi_reward"
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
    for r in rows:
        assert all(0.0 <= r[c] <= 1.0 for c in COMPONENTS), r
        assert r["train/reward"] == pytest.approx(sum(r[c] for c in COMPONENTS), abs=1e-5)
        assert math.isfinite(r["train/advantages/std"]) and math.isfinite(r["train/loss"])

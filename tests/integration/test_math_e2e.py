"""A real GRPO job from NeMo RL's grpo_math_1B.yaml (through `defaults:`): a math dataset the test makes
(problem / expected_answer), a prompt file, a validation file, the math environment, validation every
val_period steps and at start and end, all of it in TensorBoard's event files."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.common.config import load_config
from services.common.data import plan_config
from services.controller.tracking import tensorboard_dir
from services.local import LocalStack

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NEMO_1B = ROOT / "tests/fixtures/nemo_rl/examples/configs/grpo_math_1B.yaml"


def _problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"problem": f"what is {a} + {b}?", "expected_answer": str(a + b)}
            for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n))]


def _write(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _problems(16, 1)))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _problems(6, 2)))
    (tmp_path / "prompt.txt").write_text("solve: {}\nput the answer in \\boxed{{}}.")
    config = tmp_path / "math.yaml"
    # The NeMo RL file as its users write a child config: inherit, then say what differs here.
    config.write_text(f"""defaults: {NEMO_1B}
grpo: {{num_prompts_per_step: 4, num_generations_per_prompt: 4, max_num_epochs: 2, val_period: 3,
       val_at_start: true, val_at_end: true, val_num_generations_per_prompt: 2,
       async_grpo: {{enabled: true, max_trajectory_age_steps: 1}}}}
loss_fn: {{reference_policy_kl_penalty: 0.0, use_importance_sampling_correction: true}}
policy:
  model_name: tiny
  precision: float32
  max_total_sequence_length: 96
  train_global_batch_size: 16
  train_micro_batch_size: 16
  sequence_packing: {{enabled: false}}
  optimizer: {{kwargs: {{lr: 1.0e-3}}}}
  generation: {{backend: hf, max_new_tokens: 6, colocated: {{enabled: false}}}}
data:
  train: {{data_path: {tmp_path / 'train.jsonl'}, dataset_name: null, split_validation_size: 0}}
  validation: {{data_path: {tmp_path / 'val.jsonl'}}}
  default: {{prompt_file: {tmp_path / 'prompt.txt'}}}
env: {{math: {{num_workers: 1}}}}
checkpointing: {{enabled: false}}
""")
    return config


def _scalars(run_dir: Path, cfg, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(tensorboard_dir(cfg)))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)} if tag in acc.Tags()["scalars"] else {}


def test_nemo_rl_math_config_trains_on_a_local_dataset_and_reports_validation_in_tensorboard(tmp_path):
    cfg, lines = plan_config(load_config(_write(tmp_path)))
    assert cfg.grpo.max_num_steps == 8 and any("1000000 -> 8" in line for line in lines)  # 2 epochs x 16 / 4
    assert cfg.grpo.max_staleness == 1 and cfg.environments == []
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= 8, "8 steps", timeout_s=900)
        deadline = time.monotonic() + 300
        while 8 not in _scalars(tmp_path / "run", stack.cfg, "validation/accuracy") and time.monotonic() < deadline:
            time.sleep(1)
        val = _scalars(tmp_path / "run", stack.cfg, "validation/accuracy")
        passk = _scalars(tmp_path / "run", stack.cfg, "validation/pass@2")
        reward = _scalars(tmp_path / "run", stack.cfg, "train/reward")
        length = _scalars(tmp_path / "run", stack.cfg, "validation/avg_length")
    assert len(rows) == 8 and all(r["train/reward_mean"] in (0.0, *[i / 16 for i in range(17)]) for r in rows)
    assert set(val) == {0, 3, 6, 8} == set(passk)  # start, every 3 steps, end
    assert all(0.0 <= v <= 1.0 for v in [*val.values(), *passk.values()])
    assert set(reward) == set(range(1, 9))
    assert all(n > 0 for n in length.values()) and all(r["train/mean_gen_tokens_per_sample"] > 0 for r in rows)

"""NeMo RL's grpo_sliding_puzzle.yaml as a real job: the multi-turn game on puzzles the environment generates,
validated on generated puzzles through the same episode loop (several turns each), and checkpoints ranked by
that validation's accuracy (checkpointing.metric_name val:accuracy, as the config asks); `flywheel eval` on the
same config scores generated puzzles the same way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.jsonl import read_rows
from services.evaluate import run_eval
from services.local import LocalStack

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PUZZLE = ROOT / "tests/fixtures/nemo_rl/examples/configs/grpo_sliding_puzzle.yaml"
STEPS, TURNS, TOKENS = 4, 3, 4


def _write(tmp_path: Path) -> Path:
    config = tmp_path / "puzzle.yaml"
    config.write_text(f"""defaults: {PUZZLE}
grpo: {{num_prompts_per_step: 4, num_generations_per_prompt: 4, max_num_steps: {STEPS}, max_rollout_turns: {TURNS},
       val_period: 2, val_at_start: true, max_val_samples: 6}}
loss_fn: {{reference_policy_kl_penalty: 0.0}}
policy:
  model_name: tiny
  max_total_sequence_length: 512
  train_global_batch_size: 16
  train_micro_batch_size: 16
  dtensor_cfg: {{cpu_offload: false, activation_checkpointing: false}}
  generation: {{backend: hf, max_new_tokens: {TOKENS}, top_k: null, colocated: {{enabled: false}}}}
env: {{sliding_puzzle_game: {{cfg: {{game_config: {{size: 3, shuffle_moves: 4}}, max_moves: 8}}}}}}
checkpointing: {{checkpoint_dir: {tmp_path / 'checkpoints'}, save_period: 2, keep_top_k: 1}}
""")
    return config


def test_the_sliding_puzzle_trains_and_validates_on_generated_puzzles(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert [e.name for e in cfg.environments] == ["sliding_puzzle_game"] and cfg.data.train is None
    assert cfg.checkpointing.metric_name == "val:accuracy"
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=600)
        path = Path(stack.cfg.run.run_dir) / "validation.jsonl"
        deadline = time.monotonic() + 300
        while {r["version"] for r in read_rows(path)} < {0, 2, 4} and time.monotonic() < deadline:
            time.sleep(0.5)
        checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    validations = {r["version"]: r for r in read_rows(path)}
    assert set(validations) == {0, 2, 4}, validations
    for r in validations.values():
        assert r["validation/num_prompts"] == 6 and 0.0 <= r["validation/accuracy"] <= 1.0
        # A random tiny model plays every turn (it never solves a board): more tokens than one turn allows
        assert TOKENS < r["validation/avg_length"] <= TURNS * TOKENS, r
    assert all(r["train/mean_gen_tokens_per_sample"] > TOKENS for r in rows)  # multi-turn in training too
    # step_4 is the latest; step_2 is kept (the best ranked, or its validation was still pending at step_4's save)
    assert checkpoints == ["step_2", "step_4"], checkpoints


def test_flywheel_eval_scores_the_puzzles_the_environment_generates(tmp_path):
    cfg = load_config(_write(tmp_path))
    metrics = run_eval(cfg, tmp_path / "eval")
    assert metrics["validation/num_prompts"] == 6 and 0.0 <= metrics["validation/accuracy"] <= 1.0
    assert TOKENS < metrics["validation/avg_length"] <= TURNS * TOKENS  # several turns per episode
    assert len(read_rows(tmp_path / "eval" / "eval_samples.jsonl")) == 6

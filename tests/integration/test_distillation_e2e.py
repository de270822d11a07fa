"""On-policy distillation end to end on CPU, on the toy copy task: a larger tiny teacher is taught the task (SFT, the
real offline services), exported, and distilled into the smaller default tiny student by `flywheel up`'s services
(rollout samples with the student, the teacher service scores each group, the trainer steps on the KL alone).

The oracle is the toy environment's own reward of the student's samples, which is NOT in the loss
(distillation.env_reward_weight 0, NeMo RL's default): it rises only if the student learns the teacher's answers.
The trainer's `train/loss` is the step's token-mean KL to the teacher, which must fall.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.common.jsonl import read_rows
from services.common.tokenizing import check_same_vocabulary
from services.local import LocalStack
from services.trainer.export import export_checkpoint

TEACHER_SHAPE = {"hidden_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 256}
"""Larger than the student's default tiny shape (64, 2 layers, 2 heads); head_dim 32 as vLLM's CPU attention needs."""
STEPS = 60
VAL_PERIOD = 30
VALIDATED = (0, VAL_PERIOD, STEPS)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The larger tiny model taught the toy task by SFT (as test_sft_e2e.py does), exported to a Hugging Face dir."""
    from test_sft_e2e import write_sft

    tmp = tmp_path_factory.mktemp("teacher")
    write_sft(tmp / "train.jsonl", 400, seed=1)
    config = {"sft": {"max_num_steps": 60, "max_num_epochs": 3},
              "policy": {"model_name": "tiny", "tiny": TEACHER_SHAPE, "train_global_batch_size": 16,
                         "train_micro_batch_size": 8, "max_total_sequence_length": 32},
              "data": {"train": {"data_path": str(tmp / "train.jsonl")}}, "checkpointing": {"save_period": 60}}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    with LocalStack(load_config(tmp / "config.yaml"), tmp / "run") as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rs: len(rs) >= 60, "60 steps", timeout_s=900)
    print("teacher SFT loss:", rows[0]["train/loss"], "->", rows[-1]["train/loss"])
    assert rows[-1]["train/loss"] < 0.2  # taught (from about 4): each answer token follows from the prompt, floor 0
    export_checkpoint(tmp / "run" / "checkpoints", tmp / "export")
    return tmp / "export"


@pytest.mark.slow
def test_an_exported_larger_tiny_teacher_shares_the_students_vocabulary(teacher):
    check_same_vocabulary(load_config(None).policy, str(teacher))


@pytest.mark.slow
def test_a_taught_teacher_distils_into_the_student_reward_rises_and_kl_falls(teacher, tmp_path):
    config = {"policy": {"model_name": "tiny", "max_total_sequence_length": 32, "train_micro_batch_size": 16,
                         "optimizer": {"kwargs": {"lr": 0.003}}},
              "environments": [{"name": "toy", "kind": "toy_copy"}],
              "distillation": {"max_num_steps": STEPS, "num_prompts_per_step": 8, "num_generations_per_prompt": 4,
                               "val_period": VAL_PERIOD, "val_at_start": True, "max_val_samples": 16,
                               "topk_logits_k": 8},
              "teacher": {"model_name": str(teacher), "precision": "float32"},
              "grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with LocalStack(load_config(tmp_path / "config.yaml"), tmp_path / "run") as stack:
        stack.start_services()
        assert "teacher-0" in stack.children.procs
        rows = stack.wait_for(lambda rs: len(rs) >= STEPS, f"{STEPS} steps", timeout_s=900)
        path = tmp_path / "run" / "validation.jsonl"
        deadline = time.monotonic() + 300
        while {r["version"] for r in read_rows(path)} < set(VALIDATED) and time.monotonic() < deadline:
            time.sleep(0.5)

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    first, last = rows[:8], rows[-8:]
    print("distillation: reward", mean("train/reward", first), "->", mean("train/reward", last),
          "; KL", mean("train/loss", first), "->", mean("train/loss", last))
    assert mean("train/reward", last) > mean("train/reward", first) + 0.2
    assert mean("train/loss", last) < 0.5 * mean("train/loss", first)
    assert max(r["train/staleness_max"] for r in rows) <= 1  # async with the bounded staleness, as GRPO
    # Validated as GRPO is: at start and every VAL_PERIOD steps, greedy, on the student's own weights.
    validations = {r["version"]: r for r in read_rows(path)}
    print("distillation: validation", {v: round(r["validation/accuracy"], 3) for v, r in validations.items()})
    assert set(validations) == set(VALIDATED), validations
    assert all(r["validation/num_prompts"] == 16 for r in validations.values())
    assert validations[STEPS]["validation/accuracy"] > validations[0]["validation/accuracy"]

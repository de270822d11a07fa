"""kill -9 the trainer mid-SFT and mid-DPO: it resumes at its latest checkpoint on the same batch with the same loss.

The offline batches take GRPO's path (the controller publishes the dataset's rows, replay records each
step's choice), so the re-run step gets the same groups (batch_crc32) and, from the checkpoint's weights,
the same loss; every step is in the metrics once. The harness is test_kill_and_resume.py's.
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import yaml
from test_kill_and_resume import _freeze_after, _latest_checkpoint, _rows

from services.common.config import load_config
from services.environment.envs.toy_copy import DIGITS, ToyCopyEnvironment
from services.local import LocalStack, read_restarts

STEPS = 14
SAVE_PERIOD = 5
KILL_AFTER = 7


def _rows_of(algorithm: str) -> list[dict]:
    rng = random.Random(0)
    out = []
    for r in ToyCopyEnvironment().prompts(200, 1, 0):
        digit = r["metadata"]["ground_truth"]
        if algorithm == "sft":
            out.append({"messages": r["messages"] + [{"role": "assistant", "content": digit}]})
        else:
            wrong = str((int(digit) + rng.randrange(1, DIGITS)) % DIGITS)
            out.append({"prompt": r["messages"][0]["content"], "chosen": digit, "rejected": wrong})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_offline_trainer_killed_with_sigkill_resumes_at_the_checkpoint_with_the_same_batch_and_loss(tmp_path,
                                                                                                   algorithm):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows_of(algorithm)))
    config = {algorithm: {"max_num_steps": STEPS}, "data": {"train": {"data_path": str(tmp_path / "train.jsonl")}},
              "policy": {"model_name": "tiny", "train_global_batch_size": 8, "train_micro_batch_size": 4,
                         "max_total_sequence_length": 32},
              "checkpointing": {"save_period": SAVE_PERIOD, "keep_top_k": None}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    cfg = load_config(tmp_path / "config.yaml")
    run_dir = tmp_path / "run"
    with LocalStack(cfg, run_dir) as stack:
        stack.start_services()
        stack.wait_for(lambda rows: len(rows) >= 1, "a first step", timeout_s=600)
        trainer = stack.children.procs["trainer"].pid
        _freeze_after(trainer, run_dir, KILL_AFTER)
        before = {r["step"]: r for r in _rows(run_dir)}
        resumed_at = _latest_checkpoint(run_dir)
        os.kill(trainer, signal.SIGKILL)
        after = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)

    assert "trainer" in [r["service"] for r in read_restarts(run_dir)]
    assert resumed_at == SAVE_PERIOD and resumed_at in before, (resumed_at, sorted(before))
    assert [r["step"] for r in after] == list(range(STEPS)), "a step was skipped or repeated"
    print(f"{algorithm}: step {resumed_at} loss before the kill {before[resumed_at]['train/loss']:.8f}, "
          f"after {after[resumed_at]['train/loss']:.8f}")
    assert after[resumed_at]["train/loss"] == pytest.approx(before[resumed_at]["train/loss"], abs=1e-6)
    for step in range(resumed_at, max(before) + 1):
        assert after[step]["train/batch_crc32"] == before[step]["train/batch_crc32"], step
        assert after[step]["train/loss"] == pytest.approx(before[step]["train/loss"], abs=1e-6), step

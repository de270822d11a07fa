"""grpo.stop_at_validation_metric end to end: the toy run validates every 2 steps and ends, with a checkpoint of its
last step, once a validation's accuracy reaches the threshold, long before max_num_steps (real NATS, Redis, gRPC and
service processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from processes import processes_mentioning
from services.local import read_metrics

THRESHOLD = 0.5


@pytest.mark.slow
def test_a_run_ends_once_a_validation_reaches_the_threshold(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "grpo.max_num_steps=100000",
         "grpo.val_period=2", "grpo.max_val_samples=16", "grpo.stop_at_validation_metric=accuracy",
         f"grpo.stop_at_validation_threshold={THRESHOLD}"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = len(read_metrics(run_dir))
    assert f"the run ended after step {steps}: a validation reached accuracy >= {THRESHOLD:g}" in done.stdout
    assert (run_dir / "checkpoints" / f"step_{steps}" / "training_info.json").exists()  # saved as a last step
    validations = [json.loads(line) for line in (run_dir / "validation.jsonl").read_text().splitlines()]
    reached = [v["version"] for v in validations if v["validation/accuracy"] >= THRESHOLD]
    # The toy model starts near 0: it had to learn to get there, and the stop came after that validation, not before.
    assert validations[0]["validation/accuracy"] < THRESHOLD
    assert reached and 0 < min(reached) <= steps
    assert not processes_mentioning(str(run_dir)), "a process outlived flywheel up"

"""checkpointing.checkpoint_must_save_by end to end: `flywheel up` saves, stops and exits 0 before its time
limit, and `--resume` goes on from that checkpoint (real NATS, Redis, gRPC and service processes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from processes import processes_mentioning
from services.local import read_metrics

LIMIT = ["grpo.max_num_steps=100000", "checkpointing.checkpoint_must_save_by='00:00:00:03'"]


def up(run_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), *args, *LIMIT],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_run_saves_and_stops_at_its_time_limit_and_resumes_from_there(tmp_path):
    run_dir = tmp_path / "run"
    first = up(run_dir)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "stopped before its last step" in first.stdout
    stopped_at = len(read_metrics(run_dir))
    assert 0 < stopped_at < 100000
    assert (run_dir / "checkpoints" / f"step_{stopped_at}" / "training_info.json").exists()  # its last step saved
    assert not processes_mentioning(str(run_dir)), "a process outlived flywheel up"

    again = up(run_dir, "--resume")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert len(rows) > stopped_at and [r["step"] for r in rows] == list(range(len(rows)))
    assert (run_dir / "checkpoints" / f"step_{len(rows)}").exists()
    steps = [json.loads(line)["step"] for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert steps == list(range(len(rows)))  # no step lost or trained twice across the stop


@pytest.mark.slow
def test_resuming_a_complete_run_says_so_and_exits_0(tmp_path):
    """The trainer has nothing left after its final checkpoint: `flywheel up --resume` ends at once (it used to
    wait for a final step report that would never come)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "grpo.max_num_steps=3"]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "was already complete" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(read_metrics(run_dir)) == 3

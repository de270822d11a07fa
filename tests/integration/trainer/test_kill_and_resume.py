"""kill -9 the trainer mid-run: it restarts from its latest checkpoint and the run goes on exactly.

The first step after the restart trains on the same batch (replay's record of that step) with the
checkpoint's weights, so its loss equals the loss that step had before the kill; every step
appears once in the metrics, none skipped or repeated; older batches are freed by Commit.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from services.common.config import load_config
from services.local import LocalStack, read_metrics, read_restarts

STEPS = 14
SAVE_PERIOD = 5
KILL_AFTER = 7  # steps done; the checkpoint of step 4 (step_5) is the latest, the next comes after step 9


@pytest.mark.slow
# One rank and two, each engine once: a one-rank hf run checked nothing these two do not (it was 32 s of CI)
@pytest.mark.parametrize(("ranks", "backend"), [(2, "hf"), (1, "vllm")])
def test_trainer_killed_with_sigkill_resumes_at_the_checkpoint_with_the_same_batch_and_loss(tmp_path, ranks, backend):
    """With vllm, the worker must also load the resumed checkpoint's weights, older than the ones it holds."""
    cfg = load_config(None, [f"policy.generation.backend={backend}", f"grpo.max_num_steps={STEPS}", "grpo.async_grpo.max_trajectory_age_steps=1",
                             f"checkpointing.save_period={SAVE_PERIOD}", "checkpointing.keep_top_k=null",
                             f"trainer.nproc_per_node={ranks}", "weight_sync.timeout_s=10"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        stack.wait_for(lambda rows: len(rows) >= 1, "a first step", timeout_s=600)
        trainer = stack.children.procs["trainer"].pid
        _freeze_after(trainer, tmp_path, KILL_AFTER)
        before = {r["step"]: r for r in _rows(tmp_path)}  # all steps finished before the kill
        resumed_at = _latest_checkpoint(tmp_path)
        os.kill(trainer, signal.SIGKILL)  # the launcher; with 2 ranks they die with it (PDEATHSIG)
        after = stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=900)

    assert "trainer" in [r["service"] for r in read_restarts(tmp_path)]
    assert resumed_at == SAVE_PERIOD and resumed_at in before, (resumed_at, sorted(before))
    assert [r["step"] for r in after] == list(range(STEPS)), "a step was skipped or repeated"
    first = after[resumed_at]
    assert first["train/loss"] == pytest.approx(before[resumed_at]["train/loss"], abs=1e-6)
    for step in range(resumed_at, max(before) + 1):  # replay served each re-run step the same batch
        assert after[step]["train/batch_crc32"] == before[step]["train/batch_crc32"], step
    for step in range(resumed_at):  # steps the checkpoint covers were not run again
        assert after[step] == before[step]
    assert (tmp_path / "checkpoints" / f"step_{STEPS}").is_dir()


def _freeze_after(pid: int, run_dir, steps: int, timeout_s: float = 300) -> None:
    """SIGSTOP the trainer's process group as soon as `steps` rows exist.

    A tight poll and a freeze, not wait_for's 0.3 s poll and a kill: a tiny step takes ~0.1 s, and
    a late kill that lands after the next checkpoint leaves no step to re-run.
    """
    deadline = time.monotonic() + timeout_s
    while len(read_metrics(run_dir)) < steps:
        assert time.monotonic() < deadline, f"no {steps} steps in {timeout_s} s"
        time.sleep(0.01)
    os.killpg(pid, signal.SIGSTOP)


def _rows(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "step" in row]


def _latest_checkpoint(run_dir) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")]
    return max(steps)

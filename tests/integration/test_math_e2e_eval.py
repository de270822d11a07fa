"""`flywheel eval` on a checkpoint the run wrote and `flywheel export` turned into a Hugging Face
directory: it reports pass@k, and the figure is the closed form over the samples it scored."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from test_math_e2e import _write  # the same test-made math dataset, prompt file and NeMo RL config

from services.common.config import load_config
from services.common.data import plan_config
from services.local import LocalStack

pytestmark = pytest.mark.slow
N = 4


def _flywheel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=600)


def test_eval_of_an_exported_checkpoint_reports_pass_at_k_as_the_closed_form(tmp_path):
    config = _write(tmp_path)
    checkpoints = tmp_path / "ckpt"
    overrides = ["grpo.max_num_epochs=1", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
                 "checkpointing.enabled=true", "checkpointing.save_period=2", f"checkpointing.checkpoint_dir={checkpoints}",
                 "checkpointing.metric_name=null"]
    cfg, _ = plan_config(load_config(config, overrides))
    with LocalStack(cfg, tmp_path / "run") as stack:
        stack.start_services()
        stack.wait_for(lambda rows: len(rows) >= cfg.grpo.max_num_steps, "the run", timeout_s=900)
    exported = tmp_path / "hf"
    proc = _flywheel("export", str(checkpoints), str(exported))
    assert proc.returncode == 0, proc.stderr

    proc = _flywheel("eval", "--config", str(config), "--model", str(exported), "--n", str(N),
                     "--run-dir", str(tmp_path / "eval"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert f"validation/pass@{N}" in proc.stdout and "validation/accuracy" in proc.stdout
    samples = [json.loads(line) for line in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all(len(s["rewards"]) == N for s in samples)
    closed = [1 - math.comb(N - sum(r > 0 for r in s["rewards"]), N) / math.comb(N, N) for s in samples]
    assert metrics[f"validation/pass@{N}"] == pytest.approx(sum(closed) / len(closed))
    assert metrics["validation/accuracy"] == pytest.approx(sum(sum(s["rewards"]) for s in samples) / (6 * N))

    proc = _flywheel("eval", "--config", str(config), "--model", str(checkpoints), "--n", "1",  # the checkpoint itself
                     "--run-dir", str(tmp_path / "eval-ckpt"))
    assert proc.returncode == 0 and "validation/pass@1" in proc.stdout, proc.stderr[-3000:]
    assert (tmp_path / "eval-ckpt" / "hf" / "config.json").exists()

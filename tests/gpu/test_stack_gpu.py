"""Stage `stack`: `flywheel up` for 20 steps with the hf engine, the trainer on the one GPU.

It runs the command a user runs (NATS, Redis and the five services as processes, the toy task, the gloo
weight channel from the trainer's GPU to the host), then checks that every step finished, that the reward is a
number at each step, and, from nvidia-smi, where the services ran: the trainer must hold GPU memory, and the
hf rollout worker must not (`flywheel up` hides the GPUs from it, since it samples on CPU: devices.py).

FLYWHEEL_GPU_CHECK_STACK_OVERRIDES adds `key=value` overrides (CUDA_VISIBLE_DEVICES picks the devices).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from gpu_env import DEVICE, REPO, need_device
from gpu_processes import Watcher

pytestmark = pytest.mark.gpu

STEPS = int(os.environ.get("FLYWHEEL_GPU_CHECK_STEPS", "20" if DEVICE == "cuda" else "5"))
DEVICE_OVERRIDES: list[str] = os.environ.get("FLYWHEEL_GPU_CHECK_STACK_OVERRIDES", "").split()
"""Extra `key=value` overrides for `flywheel up`; see the module docstring."""
TIMEOUT_S = 140


def test_flywheel_up_trains_20_steps_with_the_trainer_on_the_gpu_and_hf_rollout_on_cpu(tmp_path, figures):
    device = need_device()
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir),
            f"grpo.max_num_steps={STEPS}", "checkpointing.enabled=false", "policy.generation.backend=hf",
            *(["policy.precision=bfloat16", "trainer.device=cuda"] if device == "cuda" else []), *DEVICE_OVERRIDES]
    figures["argv"] = argv[3:]
    start = time.monotonic()
    with Watcher() as gpu:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"flywheel up did not finish {STEPS} steps in {TIMEOUT_S} s:\n{_logs(run_dir)}\n"
                        f"{(err.stdout or b'')[-3000:]!r}")
    figures["seconds"] = round(time.monotonic() - start, 1)
    from services.local import read_metrics

    rows = read_metrics(run_dir)
    figures.update(_figures(rows), summary=[x for x in out.stdout.splitlines() if x.startswith("  ")][-6:],
                   gpu_services_mib=gpu.services, gpu_peak_mib=gpu.peak_mib,
                   gpu_baseline_mib=gpu.baseline_mib, unattributed_gpu_samples=gpu.unattributed)
    assert out.returncode == 0, f"up exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert len(rows) == STEPS and all(math.isfinite(r["train/reward_mean"]) for r in rows)
    if device == "cuda":
        assert "trainer" in gpu.services, f"no trainer process held GPU memory (nvidia-smi): {gpu.services}"
        assert "rollout" not in gpu.services, f"the hf rollout worker held GPU memory: {gpu.services}"


def _figures(rows: list[dict]) -> dict:
    if not rows:
        return {}

    def mean(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return round(sum(values) / len(values), 4) if values else float("nan")

    return {"steps": len(rows), "mean_step_s": mean("timing/train/total_step_time"),
            "mean_weight_sync_s": mean("timing/train/weight_sync"),
            "reward_first": rows[0]["train/reward_mean"], "reward_last": rows[-1]["train/reward_mean"]}


def _logs(run_dir) -> str:
    tails = []
    for log in sorted((run_dir / "logs").glob("*.log")):
        tails.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(tails)

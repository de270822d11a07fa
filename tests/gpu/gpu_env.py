"""Where the GPU check runs: the device, the skips for what a machine lacks, and the test helpers' paths.

FLYWHEEL_GPU_CHECK_DEVICE=cpu runs the checks whose logic can run on CPU (on the tiny shape), so the check
itself is exercised before a GPU run, whose time is short; the rest skip with their reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# weights_harness (receiver processes), trainer_harness (a step's batch, spawned ranks), this folder's helpers
for helpers in ("tests/integration/weights", "tests/unit/trainer", "tests/gpu"):
    if str(REPO / helpers) not in sys.path:
        sys.path.insert(0, str(REPO / helpers))

SLURM_NCCL_ENV = {**os.environ, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
"""A trainer process's environment as deploy/slurm sets it: torch's NCCL watchdog tears the process down
on a failed or timed-out collective (issue 32 item 3), the harshest setting for the checks that kill or refuse
an NCCL peer."""

DEVICE = os.environ.get("FLYWHEEL_GPU_CHECK_DEVICE", "cuda")
"""cuda (the real check) or cpu (a dry run of the check's own logic, tiny shapes)."""


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_device() -> str:
    """The device a check runs on; skips when it is cuda and there is none."""
    if DEVICE == "cpu":
        return "cpu"
    if cuda_count() == 0:
        pytest.skip("no CUDA device (FLYWHEEL_GPU_CHECK_DEVICE=cpu dry-runs the check's logic on CPU)")
    return "cuda"


def need_gpus(n: int) -> None:
    """Skip unless CUDA shows at least `n` devices (never runs on CPU: NCCL, TP over GPUs)."""
    have = cuda_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs; this machine has {have}")


def store_of(sender) -> str:
    """The store address nccl_sender.py prints first; fails with its stderr if it died before that."""
    line = sender.stdout.readline()
    if not line:
        sender.kill()
        pytest.fail(f"the sender died before its store listened:\n{sender.stderr.read()[-2000:]}")
    return json.loads(line)["store"]


def need_module(name: str, why: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed: {why}")

"""deploy/slurm/make_sbatch.py and a distillation config: the job starts no teacher server, so a config whose
teacher it would have to start is refused before the queue; one that names its teacher servers is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _make_sbatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "deploy/slurm/make_sbatch.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


CONFIG = "tests/fixtures/nemo_rl/examples/configs/distillation_math.yaml"
EDITS = ["policy.generation.colocated.enabled=false", "policy.dtensor_cfg.context_parallel_size=1"]  # docs/nemo_rl_mapping.md


def test_a_teacher_the_job_would_have_to_start_is_refused_and_one_named_by_address_is_not():
    run = _make_sbatch(CONFIG, *EDITS, "-o", "-")
    assert run.returncode == 2 and "teacher: this job starts no teacher server" in run.stderr
    run = _make_sbatch(CONFIG, *EDITS, "teacher.addresses=[node9:50057]", "-o", "-")
    assert run.returncode == 0, run.stderr

"""Fixtures for the deployment tests: a real Slurm cluster on this host."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from needs import require

HERE = Path(__file__).resolve().parent


@pytest.fixture
def slurm_cluster(tmp_path_factory, need_tools):
    """munged, slurmctld and five slurmd (logical nodes n1..n5) on this host; yields the env to use it. Five: a
    distillation job that starts the reward-model and teacher servers has five het components, and Slurm gives each
    a node of its own."""
    need_tools("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
    require(os.geteuid() == 0, "the throwaway Slurm cluster runs its daemons as root")
    state = tmp_path_factory.mktemp("slurm")
    script = HERE / "slurm_cluster.sh"
    run = subprocess.run(["bash", str(script), "start", str(state), "5"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    try:
        yield env
    finally:
        subprocess.run(["bash", str(script), "stop", str(state)], capture_output=True, text=True, timeout=60)

"""A 2-rank trainer under `flywheel up` trains, its ranks start with trainer.env_vars, and SIGTERM stops the
launcher and both ranks cleanly."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from services.common.config import load_config
from services.local import LocalStack


def _rank_pids(launcher_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _environ(pid: int) -> dict[str, str]:
    """The environment `pid` started with, as the kernel holds it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_two_rank_trainer_trains_and_stops_on_sigterm_with_code_0(tmp_path):
    cfg = load_config(None, ["grpo.max_num_steps=50", "trainer.nproc_per_node=2", "trainer.env_vars.FLYWHEEL_PROBE=1",
                             "rollout.env_vars.FLYWHEEL_ROLLOUT_PROBE=1"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= 3, "3 steps", timeout_s=600)
        launcher = stack.children.procs["trainer"]
        ranks = _rank_pids(launcher.pid)
        assert len(ranks) == 2, ranks
        for rank in ranks:  # set by the launcher before it started them; not rollout's
            env = _environ(rank)
            assert env.get("FLYWHEEL_PROBE") == "1" and "FLYWHEEL_ROLLOUT_PROBE" not in env, env
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=5)  # the house rule: every service stops within 5 s of SIGTERM
        assert launcher.returncode == 0, stack.children.tail("trainer")
        deadline = time.monotonic() + 5
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "a trainer rank outlived its launcher"
    assert all("train/loss" in r and "train/lr" in r for r in rows)

"""free_port never hands out a port another process on this host handed out within the hour: two suites at once
once gave two stacks the same port (each drew it free), and the second child to bind it failed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.common import infra

DRAWS = 500
"""Per process. Without the claims, two processes drawing 500 of the ~22,700 ports below the ephemeral range share
about 11 of them; the chance that they share none is e^-11."""

def test_two_processes_never_hand_out_the_same_port(tmp_path, monkeypatch):
    monkeypatch.setattr(infra, "CLAIMS", tmp_path / "flywheel-ports")
    code = ("import sys; from services.common import infra\n"
            f"print(' '.join(str(infra.free_port()) for _ in range({DRAWS})))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                           env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                           cwd=Path(__file__).resolve().parents[3])
    theirs = {int(p) for p in other.stdout.split()}
    ours = {infra.free_port() for _ in range(DRAWS)}
    assert len(theirs) == len(ours) == DRAWS and not theirs & ours
    assert {int(p.name) for p in (tmp_path / "flywheel-ports").iterdir()} == theirs | ours  # the claims on disk

def test_a_claim_older_than_the_hour_is_removed_and_its_port_drawn_again_later(tmp_path, monkeypatch):
    monkeypatch.setattr(infra, "CLAIMS", tmp_path)
    (tmp_path / "20000").touch()
    assert not infra._claim(20000)  # claimed now by another process
    stale = tmp_path / "20001"
    stale.touch()
    old = stale.stat().st_mtime - infra.CLAIM_S - 1

    os.utime(stale, (old, old))
    assert not infra._claim(20001) and not stale.exists()
    assert infra._claim(20001)

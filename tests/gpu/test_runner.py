"""tests/gpu/run.py, the GPU check's runner, on stages of plain tests: no GPU needed; in the normal suite.

A stage that passes, fails and skips reports one line per test; a stage past its timeout is killed with what
it started and reported as a failing `stage:` line; the run goes on after both; the summary counts them all.
"""

from __future__ import annotations

import json
import os
import time

import run

MIXED = """
import pytest

pytestmark = pytest.mark.gpu

def test_passes(figures):
    figures["gbps"] = 1.5

def test_fails():
    assert 1 == 2, "one is not two"

def test_skips():
    pytest.skip("needs 2 GPUs; this machine has 0")
"""
HANGS = """
import os, subprocess, time
import pytest

@pytest.mark.gpu
def test_hangs_with_a_child():
    child = subprocess.Popen(["sleep", "300"])
    open(os.environ["HANG_PID_FILE"], "w").write(str(child.pid))
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_runner_reports_each_check_kills_a_stage_past_its_timeout_and_goes_on(tmp_path, monkeypatch, capsys):
    tests = tmp_path / "stage"
    tests.mkdir()
    (tests / "conftest.py").write_text("from gpu_report import figures, pytest_runtest_makereport  # noqa\n")
    (tests / "test_hang.py").write_text(HANGS)
    (tests / "test_mixed.py").write_text(MIXED)
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("HANG_PID_FILE", str(pid_file))
    monkeypatch.setattr(run, "STAGES", [("slow", [str(tests / "test_hang.py")], 5),
                                        ("mixed", [str(tests / "test_mixed.py")], 60)])
    monkeypatch.setattr(run, "preflight", lambda: {"name": "preflight", "status": "pass", "seconds": 0.0,
                                                   "figures": {}, "error": ""})
    code = run.main(["--out-dir", str(tmp_path / "out")])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    lines = {line["name"].rpartition("::")[2]: line for line in printed if "name" in line}

    assert code == 1
    assert lines["stage:slow"]["status"] == "fail" and "timed out after 5 s" in lines["stage:slow"]["error"]
    deadline = time.monotonic() + 5
    while _alive(int(pid_file.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pid_file.read_text())), "the timed-out stage's child process outlived it"
    assert (lines["test_passes"]["status"], lines["test_passes"]["figures"]) == ("pass", {"gbps": 1.5})
    assert lines["test_fails"]["status"] == "fail" and "one is not two" in lines["test_fails"]["error"]
    assert (lines["test_skips"]["status"], lines["test_skips"]["error"]) == (
        "skip", "needs 2 GPUs; this machine has 0")
    summary = printed[-1]["summary"]
    assert (summary["pass"], summary["fail"], summary["skip"]) == (2, 2, 1)  # preflight is a pass
    assert [json.loads(x) for x in (tmp_path / "out" / "gpu-check.jsonl").read_text().splitlines()] == printed
    assert os.path.exists(tmp_path / "out" / "slow.log")

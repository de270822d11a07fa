"""The local launcher's supervisor on real processes: restart after a crash, budget, clean stop."""

import os
import signal
import subprocess
import sys
import time

from services.local import Children, read_metrics, read_restarts

SLEEPER = [sys.executable, "-c", "import os, subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "  # a grandchild, as trainer ranks
           "open(sys.argv[1], 'a').write(f'{os.getpid()}\\n'); time.sleep(60)"]


def supervised(tmp_path, **budget) -> tuple[Children, object]:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "svc.log").write_text("started\n")
    pids = tmp_path / "pids"
    children = Children(tmp_path, **budget)
    children.adopt("svc", lambda: subprocess.Popen([*SLEEPER, str(pids)], start_new_session=True))
    return children, pids


def wait(condition, children: Children, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert children.supervise() is None
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def started(pids) -> list[int]:
    return [int(p) for p in pids.read_text().split()] if pids.exists() else []


def test_a_killed_child_is_restarted_and_the_restart_recorded(tmp_path):
    children, pids = supervised(tmp_path)
    try:
        wait(lambda: len(started(pids)) == 1, children)
        first = children.procs["svc"]
        os.kill(first.pid, signal.SIGKILL)
        wait(lambda: len(started(pids)) == 2, children)
        assert children.procs["svc"].pid != first.pid
        assert [(r["service"], r["exit_code"]) for r in read_restarts(tmp_path)] == [("svc", -9)]
        assert read_metrics(tmp_path) == []  # restart events are not step rows
    finally:
        children.stop()


def test_a_spent_budget_stops_restarting_with_a_message(tmp_path):
    children, pids = supervised(tmp_path, max_restarts=1, window_s=60)
    try:
        wait(lambda: len(started(pids)) == 1, children)
        os.kill(children.procs["svc"].pid, signal.SIGKILL)
        wait(lambda: len(started(pids)) == 2, children)
        os.kill(children.procs["svc"].pid, signal.SIGKILL)
        children.procs["svc"].wait()
        message = children.supervise()
        assert message and "svc exited with code -9" in message and "budget" in message and "started" in message
    finally:
        children.stop()


def test_exit_zero_is_a_finish_not_a_crash(tmp_path):
    (tmp_path / "logs").mkdir()
    children = Children(tmp_path)
    children.adopt("done", lambda: subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True))
    children.procs["done"].wait()
    for _ in range(5):
        assert children.supervise() is None
    assert children.restarts == []


def test_stop_leaves_no_process_of_any_child_group(tmp_path):
    children, pids = supervised(tmp_path)
    wait(lambda: len(started(pids)) == 1, children)
    group = children.procs["svc"].pid
    children.stop()
    deadline = time.monotonic() + 5  # a killed grandchild is reaped by init a moment later
    while (alive := subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()):
        assert time.monotonic() < deadline, f"left running: {alive}"
        time.sleep(0.05)

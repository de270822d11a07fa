"""faults.py reports what /proc shows a fault did, so the chaos run's checks of its faults can fail: here on
real child processes under the launcher's real supervisor (services.local.Children)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from types import SimpleNamespace

from faults import Fault, inject, state
from services.local import Children


def _stack(tmp_path, max_restarts: int = 5, argv: tuple[str, ...] = ("sleep", "600")) -> SimpleNamespace:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "sleeper.log").touch()  # the supervisor tails it when the child dies
    children = Children(tmp_path, max_restarts=max_restarts)
    children.adopt("sleeper", lambda: subprocess.Popen(list(argv), start_new_session=True))
    return SimpleNamespace(children=children)


def _stop(stack, *escaped: int) -> None:
    for proc in stack.children.procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in escaped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_kill_is_seen_to_end_the_process_and_a_successor_to_run(tmp_path):
    stack = _stack(tmp_path)
    try:
        observed = inject(stack, Fault(step=0, action="kill", target="sleeper"), restart_within_s=30)
        assert observed.happened and observed.died
        assert observed.successor == stack.children.procs["sleeper"].pid != observed.pid
        assert state(observed.pid) is None  # reaped
    finally:
        _stop(stack)


def _with_grandchild(prefix: str) -> tuple[str, ...]:
    """A shell whose child (`prefix` sleep) adds its pid to grandchild.pid, so the test knows it started before
    the kill and can end every one it left."""
    return ("sh", "-c", f"{prefix} sh -c 'echo $$ >> \"$0\"; exec sleep 600' \"$PWD/grandchild.pid\" & wait")


def test_a_descendant_that_outlives_the_killed_process_is_a_survivor_and_the_kill_did_not_happen(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stack = _stack(tmp_path, argv=_with_grandchild("setsid"))  # out of the group the supervisor kills
    try:
        assert _until_file(tmp_path / "grandchild.pid")
        grandchild = int((tmp_path / "grandchild.pid").read_text())
        observed = inject(stack, Fault(step=0, action="kill", target="sleeper"), restart_within_s=30)
        assert observed.died and observed.successor is not None
        assert grandchild in observed.survivors and not observed.happened
    finally:
        time.sleep(0.5)  # the successor's own escapee writes its pid down
        _stop(stack, *map(int, (tmp_path / "grandchild.pid").read_text().split()))


def test_a_descendant_in_the_killed_process_group_is_killed_with_it_by_the_supervisor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stack = _stack(tmp_path, argv=_with_grandchild(""))
    try:
        assert _until_file(tmp_path / "grandchild.pid")
        observed = inject(stack, Fault(step=0, action="kill", target="sleeper"), restart_within_s=30)
        assert observed.happened and observed.survivors == ()
    finally:
        _stop(stack)


def _until_file(path, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (path.exists() and path.read_text().strip()):
        time.sleep(0.05)
    return path.exists()


def test_a_kill_that_nothing_restarts_is_reported_as_not_happened(tmp_path):
    stack = _stack(tmp_path, max_restarts=0)  # the supervisor's budget is spent: no successor comes
    try:
        observed = inject(stack, Fault(step=0, action="kill", target="sleeper"), restart_within_s=3)
        assert observed.died and observed.successor is None and not observed.happened
    finally:
        _stop(stack)


def test_a_pause_is_seen_as_state_t_and_the_process_runs_after(tmp_path):
    stack = _stack(tmp_path)
    try:
        observed = inject(stack, Fault(step=0, action="pause", target="sleeper"), pause_s=0.5)
        assert observed.happened and observed.stopped
        assert state(observed.pid) not in ("T", None)
    finally:
        _stop(stack)

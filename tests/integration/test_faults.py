"""faults.py reports what /proc shows a fault did, so the chaos run's checks of its faults can fail: here on
real child processes under the launcher's real supervisor (services.local.Children)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

from faults import Fault, inject, state
from services.local import Children


def _stack(tmp_path, max_restarts: int = 5) -> SimpleNamespace:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "sleeper.log").touch()  # the supervisor tails it when the child dies
    children = Children(tmp_path, max_restarts=max_restarts)
    children.adopt("sleeper", lambda: subprocess.Popen(["sleep", "600"], start_new_session=True))
    return SimpleNamespace(children=children)


def _stop(stack) -> None:
    for proc in stack.children.procs.values():
        proc.kill()
        proc.wait()


def test_a_kill_is_seen_to_end_the_process_and_a_successor_to_run(tmp_path):
    stack = _stack(tmp_path)
    try:
        observed = inject(stack, Fault(step=0, action="kill", target="sleeper"), restart_within_s=30)
        assert observed.happened and observed.died
        assert observed.successor == stack.children.procs["sleeper"].pid != observed.pid
        assert state(observed.pid) is None  # reaped
    finally:
        _stop(stack)


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

"""The GPU check's report as pytest hooks: one JSON line per test, and the `figures` fixture that fills it.

With FLYWHEEL_GPU_REPORT=FILE set (tests/gpu/run.py sets it), each test appends one line to FILE:
{"name", "status": pass|fail|skip, "seconds", "figures", "error"}. tests/gpu/conftest.py imports it.
"""

from __future__ import annotations

import json
import os
import time

import pytest


@pytest.fixture
def figures(request) -> dict:
    """Measurements a check reports in its JSON line (seconds, GB/s, memory, ...); filled by the test."""
    request.node.figures = {}
    return request.node.figures


@pytest.hookimpl(hookwrapper=True)  # the old-style wrapper: any pytest the GPU machine has takes it
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # One line per test: from the call phase, or from setup when it skipped or failed there.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _write_line(item, report)


def _write_line(item, report) -> None:
    path = os.environ.get("FLYWHEEL_GPU_REPORT")
    if not path:
        return
    if report.skipped:
        status, error = "skip", _skip_reason(report)
    else:
        status, error = ("pass", "") if report.passed else ("fail", _last_lines(report.longreprtext))
    line = {"name": item.nodeid, "status": status, "seconds": round(report.duration, 3),
            "figures": getattr(item, "figures", {}), "error": error, "unix_time": round(time.time(), 1)}
    with open(path, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]).removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)


def _last_lines(text: str, n: int = 25) -> str:
    return "\n".join(text.splitlines()[-n:])

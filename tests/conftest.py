"""Shared fixtures: real NATS and Redis servers on free loopback ports, one per test; the default ports held for
the whole session (tests/ports.py); tool checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from needs import require_tools
from ports import default_ports, holding
from services.common.infra import Server, start_nats, start_redis


def pytest_collection_modifyitems(config, items):
    """Files with a test marked slow first, then the others, each group in collection order, and among the slow
    ones the deploy files (tests/deploy: docker, pip, sbatch, which mostly wait) every other one. `make test`
    hands whole files to two workers in this order (--dist loadfile --no-loadscope-reorder; by default xdist
    orders files by their number of tests, which put the one-test end-to-end runs last), alternately at the
    start: with the long files first, the last ones a worker takes are short and neither waits long at the end
    for the other; with a deploy file beside a stack's file, the cores its waits leave idle are used (two deploy
    files side by side left the machine 20-40% idle for four minutes)."""
    files = list(dict.fromkeys(item.path for item in items))
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    waiting = [f for f in files if f in slow and "deploy" in f.relative_to(config.rootpath).parts[:2]]
    busy = [f for f in files if f in slow and f not in waiting]
    order = [f for pair in zip(waiting, busy) for f in pair] + busy[len(waiting):] + waiting[len(busy):]
    order += [f for f in files if f not in slow]
    rank = {f: i for i, f in enumerate(order)}
    items.sort(key=lambda item: rank[item.path])


@pytest.fixture(scope="session", autouse=True)
def default_ports_held():
    """A test that binds or dials a default port fails here, not only when another suite shares the host."""
    with holding(default_ports()):
        yield


@pytest.fixture
def nats_server(tmp_path) -> Server:
    server = start_nats(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path) -> Server:
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def need_tools():
    """require_tools (tests/needs.py), for tests: a missing tool skips, and fails under FLYWHEEL_CI=1."""
    return require_tools


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, worker_id):
    """The tiny model briefly supervised on tool_add's episodes (tests/tool_demos.py), made once per test run: the
    tool-call tests of the endpoint and of the local stack start from the same one. xdist's workers share it
    through their common base directory, the first to need it making it under a lock (each worker made its own,
    up to 180 s each on a loaded machine)."""
    from filelock import FileLock
    from tool_demos import warm_start

    def make(out: Path) -> Path:
        return warm_start(out, steps=180, answer_fraction=1.0, threads=1)

    if worker_id == "master":  # not under xdist
        return make(tmp_path_factory.mktemp("tool_model"))
    out = tmp_path_factory.getbasetemp().parent / "tool_model"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            make(out.with_suffix(".partial")).rename(out)  # a worker killed mid-way leaves no half model
    return out

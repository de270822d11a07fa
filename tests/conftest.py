"""Shared fixtures: real NATS and Redis servers on free loopback ports, one per test; tool checks."""

from __future__ import annotations

import os
import shutil

import pytest

from services.common.infra import Server, start_nats, start_redis


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


def require_tools(*tools: str) -> None:
    """Skip unless every named tool is on PATH. `make test` installs them (tests/with_system_tools.sh); under
    CI (FLYWHEEL_CI=1) a missing tool fails instead, so a set-up gap cannot hide as a skip."""
    missing = [t for t in tools if not shutil.which(t)]
    if not missing:
        return
    message = f"not installed: {', '.join(missing)}"
    if os.environ.get("FLYWHEEL_CI") == "1":
        pytest.fail(f"{message} (make test installs them: tests/with_system_tools.sh)")
    pytest.skip(message)


@pytest.fixture
def need_tools():
    """require_tools, for tests."""
    return require_tools


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """The tiny model briefly supervised on tool_add's episodes (tests/tool_demos.py), made once per session:
    the tool-call tests of the endpoint and of the local stack start from the same one."""
    from tool_demos import warm_start

    return warm_start(tmp_path_factory.mktemp("tool_model"), steps=180, answer_fraction=1.0)

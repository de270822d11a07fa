"""Shared fixtures: real NATS and Redis servers on free loopback ports, one per test; tool checks."""

from __future__ import annotations

import pytest

from needs import require_tools
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


@pytest.fixture
def need_tools():
    """require_tools (tests/needs.py), for tests: a missing tool skips, and fails under FLYWHEEL_CI=1."""
    return require_tools

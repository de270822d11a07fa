"""Shared fixtures: real NATS and Redis servers on free loopback ports, one per test."""

from __future__ import annotations

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

"""The suite holds the configuration's default ports (tests/ports.py), so no test can use one: here a real server
tries each, as a test that forgot to ask for a free port would, and fails; a free port works."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest
from ports import default_ports, holding

from services.common.infra import free_port, start_redis


@pytest.fixture(autouse=True)
def held_here_if_free():
    """What the session found held by another process (another suite, or the other xdist worker) may be free by
    now, if that process ended: held here then, so the checks below see every default port held."""
    with holding(default_ports()):
        yield


def test_the_default_ports_are_the_configs():
    assert {4222, 6379, 50051, 50052, 50053, 50054, 50055, 50056} <= set(default_ports())


@pytest.mark.parametrize("port", default_ports())
def test_a_server_on_a_default_port_cannot_start_during_the_suite(port):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # sync: needs no event loop
    with pytest.raises(RuntimeError, match="Failed to bind"):
        server.add_insecure_port(f"127.0.0.1:{port}")


def test_dialling_a_default_port_is_refused_at_once():
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", default_ports()[-1]), timeout=5).close()


def test_redis_on_a_default_port_fails_and_on_a_free_one_starts(tmp_path):
    with pytest.raises(RuntimeError, match="redis-server exited"):
        start_redis(tmp_path / "held", 6379)
    start_redis(tmp_path / "free", free_port()).stop()

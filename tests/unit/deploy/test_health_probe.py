"""deploy/health_probe.py, the gRPC health probe the compose health checks and the Slurm launcher use."""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.infra import free_port

PROBE = Path(__file__).resolve().parents[3] / "deploy" / "health_probe.py"


@pytest.fixture()
def server():
    port = free_port()
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    srv.add_insecure_port(f"127.0.0.1:{port}")
    srv.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("flywheel.v1.replay", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("flywheel.v1.trainer", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=30)


def test_serving_service_exits_0(server):
    assert probe(server, "flywheel.v1.replay").returncode == 0
    assert probe(server).returncode == 0  # "" = the whole server


def test_not_serving_and_unknown_exit_1(server):
    run = probe(server, "flywheel.v1.trainer")
    assert run.returncode == 1 and "NOT_SERVING" in run.stderr
    run = probe(server, "flywheel.v1.nothing")
    assert run.returncode == 1 and "NOT_FOUND" in run.stderr


def test_unreachable_exits_1_within_the_timeout():
    run = probe(f"127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert run.returncode == 1 and ("UNAVAILABLE" in run.stderr or "DEADLINE_EXCEEDED" in run.stderr)

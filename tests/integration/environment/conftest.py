"""Remote-environment fixtures: real gRPC servers on free loopback ports.

`faulty_remote` is an in-process EnvironmentService whose behaviour a test switches
(ok, hang, wrong_count, nan, error); `example_remote` is examples/remote_env_server.py in its
own process, so a test can kill it.
"""

from __future__ import annotations

import grpc
import pytest

from env_harness import FaultyEnvironment, Remote, start_example_server
from services.common.pb.flywheel.v1 import environment_pb2_grpc


@pytest.fixture
async def faulty_remote():
    servicer = FaultyEnvironment()
    server = grpc.aio.server()
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield Remote(servicer=servicer, address=f"127.0.0.1:{port}")
    await server.stop(0)


@pytest.fixture
def example_remote():
    proc, address = start_example_server()
    yield proc, address
    if proc.poll() is None:
        proc.kill()
    proc.wait()

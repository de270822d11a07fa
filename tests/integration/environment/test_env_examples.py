"""The examples run as tests: submit_env.py against a controller stand-in that checks the token and keeps the spec."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest

from services.common.pb.flywheel.v1 import controller_pb2, controller_pb2_grpc
from services.common.server import ErrorInterceptor
from services.controller.auth import interceptors

from env_harness import REPO

TOKEN = "example-token"


class RecordingController(controller_pb2_grpc.ControllerServiceServicer):
    def __init__(self) -> None:
        self.specs: list[controller_pb2.EnvironmentSpec] = []

    async def SubmitEnvironment(self, request, context):
        self.specs.append(request.spec)
        return controller_pb2.SubmitEnvironmentResponse(num_prompts=len(request.spec.rows))

    async def ListEnvironments(self, request, context):
        return controller_pb2.ListEnvironmentsResponse(
            environments=[controller_pb2.EnvironmentStatus(spec=s) for s in self.specs])


@pytest.fixture
async def controller():
    servicer = RecordingController()
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), *interceptors(TOKEN)])
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


async def submit(address: str, token: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "examples" / "submit_env.py"), "--controller", address,
        "--address", "127.0.0.1:7000", "--name", "first_char", "--weight", "0.5", "--token", token,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_submit_env_example_sends_an_inline_dataset_and_a_weight(controller):
    servicer, address = controller
    code, out, err = await submit(address, TOKEN)
    assert code == 0, err
    assert "submitted first_char: 50 prompts, weight 0.5" in out
    (spec,) = servicer.specs
    assert (spec.address, spec.weight, len(spec.rows)) == ("127.0.0.1:7000", 0.5, 50)
    assert spec.rows[3].messages[0].content == "copy 3" and spec.rows[3].metadata["ground_truth"] == "3"


async def test_submit_env_example_reports_a_missing_token(controller):
    servicer, address = controller
    code, _, err = await submit(address, "")
    assert code == 1 and "UNAUTHENTICATED" in err and not servicer.specs

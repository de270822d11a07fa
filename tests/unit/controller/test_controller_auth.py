"""Bearer-token auth on the controller's admin API: a real grpc.aio server on a free port."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.pb.flywheel.v1 import controller_pb2, controller_pb2_grpc
from services.common.server import ErrorInterceptor
from services.controller.auth import BearerAuthInterceptor, bearer_token, interceptors
from services.controller.client import ControllerClient

TOKEN = "s3cret-token"


class FakeController(controller_pb2_grpc.ControllerServiceServicer):
    async def Status(self, request, context):
        return controller_pb2.StatusResponse(trained_step=7)


@pytest.fixture
async def address():
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), *interceptors(TOKEN)])
    controller_pb2_grpc.add_ControllerServiceServicer_to_server(FakeController(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.mark.parametrize("token, why", [("", "missing bearer token"), ("wrong", "invalid bearer token")])
async def test_admin_rpc_without_the_token_is_unauthenticated(address, token, why):
    client = ControllerClient(address, token=token, timeout_s=5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.status()
    await client.close()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and why in info.value.details()


async def test_admin_rpc_with_the_token_succeeds(address):
    client = ControllerClient(address, token=TOKEN, timeout_s=5)
    assert (await client.status()).trained_step == 7
    await client.close()


async def test_health_checks_need_no_token(address):
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_token_configured_means_no_interceptor():
    assert interceptors("") == []
    with pytest.raises(ValueError):
        BearerAuthInterceptor("")


@pytest.mark.parametrize("metadata, token", [
    ((("authorization", "Bearer abc"),), "abc"),
    ((("Authorization", "bearer  abc "),), "abc"),
    ((("authorization", b"Bearer abc"),), "abc"),
    ((("authorization", "Basic abc"),), None),
    ((("authorization", "Bearer "),), None),
    ((), None),
    (None, None),
])
def test_bearer_token_is_read_from_the_authorization_entry(metadata, token):
    assert bearer_token(metadata) == token

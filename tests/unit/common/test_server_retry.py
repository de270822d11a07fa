"""`retrying`: a long-running caller outlasts refusals and restarts on the server's side (real grpc.aio server)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc
from services.common.server import RPC_ERRORS, ErrorInterceptor, retrying


class Flaky(replay_pb2_grpc.ReplayServiceServicer):
    """Commit fails with the queued errors first, then answers."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors

    async def Commit(self, request, context):
        if self.errors:
            raise self.errors.pop(0)
        return replay_pb2.CommitResponse(deleted_groups=request.step)


@pytest.fixture
async def serve():
    servers = []

    async def start(servicer) -> replay_pb2_grpc.ReplayServiceStub:
        server = grpc.aio.server(interceptors=[ErrorInterceptor()])
        replay_pb2_grpc.add_ReplayServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append((server, channel := grpc.aio.insecure_channel(f"127.0.0.1:{port}")))
        return replay_pb2_grpc.ReplayServiceStub(channel)

    yield start
    for server, channel in servers:
        await channel.close()
        await server.stop(0)


def _count(code: str) -> float:
    return RPC_ERRORS.labels("test.Commit", code)._value.get()


async def test_refusals_and_unavailability_are_retried_and_counted(serve):
    stub = await serve(Flaky([FailedPrecondition("not yet"), Unavailable("restarting"), FailedPrecondition("no")]))
    before = _count("FAILED_PRECONDITION"), _count("UNAVAILABLE")
    reply = await retrying(stub.Commit, replay_pb2.CommitRequest(step=3), rpc="test.Commit",
                           stop=asyncio.Event(), timeout=10)
    assert reply.deleted_groups == 3
    assert (_count("FAILED_PRECONDITION") - before[0], _count("UNAVAILABLE") - before[1]) == (2, 1)


async def test_a_request_the_server_calls_wrong_is_raised_not_repeated(serve):
    stub = await serve(Flaky([InvalidArgument("step must be >= 0")]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await retrying(stub.Commit, replay_pb2.CommitRequest(step=3), rpc="test.Commit",
                       stop=asyncio.Event(), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stop_ends_the_retries(serve):
    stub = await serve(Flaky([FailedPrecondition("never")] * 10_000))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, stop.set)
    assert await retrying(stub.Commit, replay_pb2.CommitRequest(step=3), rpc="test.Commit",
                          stop=stop, timeout=10) is None

"""The shared error mapping on a real grpc.aio server: undecodable requests, typed errors, crashes."""

from __future__ import annotations

import logging
import os

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from services.common.errors import FailedPrecondition, NotFound
from services.common.pb.flywheel.v1 import replay_pb2
from services.common.logs import RateLimitedLog
from services.common.server import ErrorInterceptor

COMMIT = "/flywheel.v1.ReplayService/Commit"
CORRUPT = b"\x0a\xff\xff\xff\xff\xff"  # field 1, length-delimited, with a truncated length varint


async def _commit(request: replay_pb2.CommitRequest, context) -> replay_pb2.CommitResponse:
    if request.step == 13:
        raise FailedPrecondition("step 13 is not checkpointed")
    if request.step == 66:
        raise RuntimeError("boom")
    if request.step == 77:  # a message that quotes a huge request field
        raise NotFound(f"no environment named {'é' * 1_000_000!r}")
    return replay_pb2.CommitResponse(deleted_groups=request.step)


@pytest.fixture
async def address():
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    handlers = {"Commit": grpc.unary_unary_rpc_method_handler(
        _commit, request_deserializer=replay_pb2.CommitRequest.FromString,
        response_serializer=replay_pb2.CommitResponse.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("flywheel.v1.ReplayService", handlers),))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _raw(address: str, method: str, payload: bytes, stream: bool = False) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        call = (channel.unary_stream if stream else channel.unary_unary)(method)(payload, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if stream:
                async for _ in call:
                    pass
            else:
                await call
    return info.value


async def test_an_undecodable_request_is_invalid_argument_naming_the_message(address):
    err = await _raw(address, COMMIT, CORRUPT)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not decode as flywheel.v1.CommitRequest" in err.details()


@pytest.mark.parametrize("method, stream", [("/grpc.health.v1.Health/Check", False),
                                            ("/grpc.health.v1.Health/Watch", True)])
async def test_undecodable_health_requests_are_invalid_argument_too(address, method, stream):
    err = await _raw(address, method, CORRUPT, stream)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()


async def test_random_bytes_never_come_back_unknown_or_internal(address):
    codes = set()
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(COMMIT)
        for _ in range(300):
            try:
                await call(os.urandom(int.from_bytes(os.urandom(1), "big") % 64), timeout=10)
                codes.add(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as err:
                codes.add(err.code())
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
    assert grpc.StatusCode.INVALID_ARGUMENT in codes


async def test_a_flood_of_undecodable_requests_logs_one_warning_and_no_error(address, caplog):
    caplog.set_level(logging.WARNING, logger="flywheel.server")
    for _ in range(50):
        await _raw(address, COMMIT, CORRUPT)
    records = [r for r in caplog.records if r.name == "flywheel.server"]
    assert [r.levelno for r in records] == [logging.WARNING]


async def test_typed_errors_keep_their_code_and_crashes_are_internal(address):
    async with grpc.aio.insecure_channel(address) as channel:
        commit = channel.unary_unary(COMMIT, request_serializer=replay_pb2.CommitRequest.SerializeToString,
                                     response_deserializer=replay_pb2.CommitResponse.FromString)
        assert (await commit(replay_pb2.CommitRequest(step=4), timeout=10)).deleted_groups == 4
        for step, code in ((13, grpc.StatusCode.FAILED_PRECONDITION), (66, grpc.StatusCode.INTERNAL)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await commit(replay_pb2.CommitRequest(step=step), timeout=10)
            assert info.value.code() == code


def test_rate_limited_log_reports_what_it_suppressed(caplog):
    caplog.set_level(logging.WARNING)
    limited = RateLimitedLog(logging.getLogger("t"), period_s=0.0)
    limited.period_s = 3600.0
    limited.warning("k", "first")
    limited.warning("k", "second")
    limited.warning("other", "third")
    limited.period_s = 0.0
    limited.warning("k", "fourth")
    assert [r.getMessage() for r in caplog.records] == ["first", "third",
                                                         "fourth (1 more since the last report)"]


async def test_a_typed_error_quoting_a_huge_field_keeps_its_code_with_its_message_cut(address):
    err = await _raw(address, COMMIT, replay_pb2.CommitRequest(step=77).SerializeToString())
    assert err.code() == grpc.StatusCode.NOT_FOUND  # not RESOURCE_EXHAUSTED: the trailer fits
    assert err.details().startswith("no environment named 'éé") and err.details().endswith("more bytes)")
    assert len(err.details().encode()) < 2100

"""The rollout's StepBatcher against a real environment service on loopback: groups that score in the same
turn of the event loop share one Step rpc, each gets its own episodes' results, and a group the service
refuses fails alone."""

from __future__ import annotations

import asyncio
import contextlib
import math

import grpc
from environment_service import serve_environment

from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.structs import to_struct
from services.rollout.steps import StepBatcher


class CountSteps(grpc.aio.ServerInterceptor):
    """Counts the Step calls; with `busy` set, answers them UNAVAILABLE, as a service that sheds load."""

    def __init__(self) -> None:
        self.calls = 0
        self.busy = False

    async def intercept_service(self, continuation, details):
        if not details.method.endswith("/Step"):
            return await continuation(details)
        self.calls += 1
        if self.busy:
            async def refuse(request, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
            return grpc.unary_unary_rpc_method_handler(refuse)
        return await continuation(details)


def _episodes(ground_truth, *answers: str) -> list[environment_pb2.Episode]:
    """toy_copy episodes: reward 1 where the answer starts with the ground truth."""
    return [environment_pb2.Episode(
        messages=[types_pb2.ChatMessage(role="user", content=f"copy {ground_truth}"),
                  types_pb2.ChatMessage(role="assistant", content=answer)],
        metadata=to_struct({"ground_truth": ground_truth})) for answer in answers]


@contextlib.asynccontextmanager
async def _batcher(**kwargs):
    """A StepBatcher over a real environment service with toy_copy registered as "toy", and its Step counter."""
    counter = CountSteps()
    server, port = await serve_environment(interceptors=[counter])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = environment_pb2_grpc.EnvironmentServiceStub(channel)
            await stub.Register(environment_pb2.RegisterRequest(name="toy", kind="toy_copy"))
            yield StepBatcher(stub, timeout_s=30, **kwargs), counter
    finally:
        await server.stop(0)


async def test_groups_that_score_together_share_one_step_and_each_gets_its_own_results():
    async with _batcher() as (batcher, counter):
        a, b = await asyncio.gather(batcher.step("toy", _episodes("1", "1", "2")),
                                    batcher.step("toy", _episodes("3", "3", "3", "0")))
        assert counter.calls == 1
        assert [r.reward for r in a] == [1.0, 0.0]
        assert [r.reward for r in b] == [1.0, 1.0, 0.0]
        await batcher.step("toy", _episodes("4", "4"))  # a call alone goes alone, at once
        await batcher.step("toy", _episodes("4", "0"))
        assert counter.calls == 3


async def test_a_merged_request_stays_under_its_byte_limit():
    groups = [_episodes("1", "1", "2"), _episodes("3", "3"), _episodes("0", "0", "0")]
    two = sum(e.ByteSize() for e in groups[0] + groups[1])
    async with _batcher(max_request_bytes=two) as (batcher, counter):
        results = await asyncio.gather(*(batcher.step("toy", episodes) for episodes in groups))
        assert counter.calls == 2  # the first two groups together, the third alone
        assert [[r.reward for r in group] for group in results] == [[1.0, 0.0], [1.0], [1.0, 1.0]]


async def test_a_group_the_service_refuses_fails_alone():
    bad = _episodes("1", "1")
    bad[0].metadata.update({"weight": math.nan})  # a Struct number JSON cannot hold: INVALID_ARGUMENT
    async with _batcher() as (batcher, counter):
        a, refused, b = await asyncio.gather(batcher.step("toy", _episodes("1", "1", "2")), batcher.step("toy", bad),
                                             batcher.step("toy", _episodes("3", "0")), return_exceptions=True)
        assert counter.calls == 1 + 3  # the merged call, then each group on its own
        assert [r.reward for r in a] == [1.0, 0.0]
        assert [r.reward for r in b] == [0.0]
        assert isinstance(refused, grpc.aio.AioRpcError)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        counter.busy, counter.calls = True, 0  # a refusal that a later try may not meet: every group gets it,
        busy = await asyncio.gather(batcher.step("toy", _episodes("1", "1")),  # and no group is tried again now
                                    batcher.step("toy", _episodes("2", "2")), return_exceptions=True)
        assert counter.calls == 1
        assert [e.code() for e in busy] == [grpc.StatusCode.UNAVAILABLE] * 2

"""Sample and Commit are checked against the trainer's reported progress: no caller can skip ahead,
rewind, or free batches the trainer may still need. Real NATS, Redis and gRPC, in process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from conftest import report, running_replay, until, with_grpo
from groups import make_group
from services.common.pb.flywheel.v1 import replay_pb2, types_pb2
from services.replay import server as replay_server

PER_STEP = 2
K = 100  # nothing goes stale in these tests


def sample(step: int, per_step: int = PER_STEP, k: int = K) -> replay_pb2.SampleRequest:
    return replay_pb2.SampleRequest(step=step, prompts_per_step=per_step, max_staleness=k)


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@pytest.fixture
def run_cfg(cfg):
    return with_grpo(cfg, num_prompts_per_step=PER_STEP, max_staleness=K)


async def fill(bus, replay, n: int) -> None:
    for i in range(n):
        await bus.publish(bus.subjects.trajectories, make_group(f"g{i}", 0))

    async def stored() -> bool:
        return (await replay.store.stats()).size >= n

    await until(stored, f"{n} groups")


async def test_sample_past_the_trainer_is_refused_and_takes_no_groups(run_cfg, bus):
    async with running_replay(run_cfg) as (replay, stub):
        await fill(bus, replay, 4)
        err = await refused(stub.Sample(sample(113)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "next step to sample is 0" in err.details()
        assert (await replay.store.stats()).size == 4
        first = await stub.Sample(sample(0))
        assert first.ready and (await stub.Sample(sample(0))) == first  # an old step is replayed, unchanged
        assert (await refused(stub.Sample(sample(2)))).code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (await stub.Sample(sample(1))).ready


async def test_sample_of_another_shape_than_the_run_is_refused(run_cfg, bus):
    async with running_replay(run_cfg) as (replay, stub):
        await fill(bus, replay, 4)
        for request in (sample(0, per_step=1), sample(0, k=0)):
            err = await refused(stub.Sample(request))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "this run samples" in err.details()
        assert (await replay.store.stats()).size == 4


async def test_commit_ahead_of_the_trainer_or_its_checkpoint_is_refused_and_deletes_nothing(run_cfg, bus,
                                                                                            monkeypatch):
    monkeypatch.setattr(replay_server, "REPORT_WAIT_S", 0.3)
    async with running_replay(run_cfg) as (replay, stub):
        await fill(bus, replay, 4)
        batches = [await stub.Sample(sample(s)) for s in (0, 1)]
        await report(bus, replay, step=1)
        far = await refused(stub.Commit(replay_pb2.CommitRequest(step=113)))
        unreported = await refused(stub.Commit(replay_pb2.CommitRequest(step=1)))  # no checkpoint reported
        assert far.code() == unreported.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "current step 1" in far.details() and "checkpoint" in unreported.details()
        assert [await stub.Sample(sample(s)) for s in (0, 1)] == batches  # both batches are still there
        await report(bus, replay, step=1, checkpoint_step=0)
        assert (await stub.Commit(replay_pb2.CommitRequest(step=0))).deleted_groups == PER_STEP
        assert (await stub.Commit(replay_pb2.CommitRequest(step=0))).deleted_groups == 0  # a retry is harmless
        assert (await refused(stub.Commit(replay_pb2.CommitRequest(step=1)))).code() == \
            grpc.StatusCode.FAILED_PRECONDITION
        assert await stub.Sample(sample(1)) == batches[1]


async def test_commit_backwards_is_refused(run_cfg, bus):
    async with running_replay(run_cfg) as (replay, stub):
        await fill(bus, replay, 4)
        for s in (0, 1):
            await stub.Sample(sample(s))
        await report(bus, replay, step=1, checkpoint_step=1)
        await stub.Commit(replay_pb2.CommitRequest(step=1))
        err = await refused(stub.Commit(replay_pb2.CommitRequest(step=0)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "only move forward" in err.details()


async def test_commit_waits_for_a_step_report_that_trails_it(run_cfg, bus):
    async with running_replay(run_cfg) as (replay, stub):
        await fill(bus, replay, 2)
        await stub.Sample(sample(0))
        commit = asyncio.ensure_future(stub.Commit(replay_pb2.CommitRequest(step=0)))
        await asyncio.sleep(0.2)
        assert not commit.done()
        await bus.emit(bus.subjects.train_step, types_pb2.StepReport(step=0, checkpoint_step=0))
        assert (await commit).deleted_groups == PER_STEP


async def test_step_reports_only_raise_the_trainer_progress(run_cfg, bus):
    async with running_replay(run_cfg) as (replay, _):
        await report(bus, replay, step=5, checkpoint_step=4)
        await bus.nc.publish(bus.subjects.train_step, b"\xff\xff not a report")
        # An older report, and one whose checkpoint is past its own step (it counts only up to its step):
        await bus.emit(bus.subjects.train_step, types_pb2.StepReport(step=2, checkpoint_step=9))
        await report(bus, replay, step=6)  # recorded after the ones before it on the same connection
        assert await replay.store.trainer_progress() == (6, 4)

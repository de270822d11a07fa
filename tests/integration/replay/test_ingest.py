"""Ingest through real NATS JetStream into real Redis, and Sample/Stats/Commit over gRPC in process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from conftest import running_replay, until
from groups import make_group
from services.common.pb.flywheel.v1 import replay_pb2, types_pb2
from services.replay.ingest import CONSUMER, REASON_HEADER
from services.replay.main import open_replay
from services.replay.store import Put


def with_replay(cfg, **fields):
    return cfg.model_copy(update={"replay": cfg.replay.model_copy(update=fields)})


async def stats_are(replay, **expected) -> bool:
    stats = await replay.store.stats()
    return all(getattr(stats, key) == value for key, value in expected.items())


async def test_group_published_twice_is_stored_once(cfg, bus):
    async with running_replay(cfg) as (replay, _):
        for _ in range(2):
            await bus.publish(bus.subjects.trajectories, make_group("g1"))
        await until(lambda: stats_are(replay, size=1, duplicates=1), "one group and one duplicate")


async def test_nacked_message_is_redelivered_and_stored_once(cfg, bus):
    await bus.publish(bus.subjects.trajectories, make_group("g1"))
    async with open_replay(cfg) as replay:
        sub = await replay.ingest.subscribe()
        [msg] = await sub.fetch(1, timeout=10)
        await replay.store.put(Put(group_id="g1", version_start=0, finished_at_s=0.0, payload=msg.data))
        await msg.nak()  # the write happened, the ack did not: as if the service died in between
        await sub.unsubscribe()
    async with running_replay(cfg) as (replay, _):
        await until(lambda: stats_are(replay, size=1, duplicates=1), "the redelivery to be ignored")


async def test_malformed_message_is_dead_lettered_counted_and_ingest_continues(cfg, bus):
    dead: asyncio.Queue = asyncio.Queue()

    async def on_dead(msg):
        await dead.put(msg)

    await bus.nc.subscribe(bus.subjects.dead_letter, cb=on_dead)
    empty = make_group("bad")
    del empty.completions[:]
    async with running_replay(cfg) as (replay, _):
        await bus.js.publish(bus.subjects.trajectories, b"\xff\xff\xff not a group")
        await bus.publish(bus.subjects.trajectories, empty)
        await bus.publish(bus.subjects.trajectories, make_group("good"))
        await until(lambda: stats_are(replay, size=1, dead_lettered=2), "two dead letters and the good group")
        first, second = await dead.get(), await dead.get()
    assert first.data == b"\xff\xff\xff not a group" and first.headers[REASON_HEADER].startswith("undecodable")
    assert second.headers[REASON_HEADER] == "no completions"


async def test_full_buffer_leaves_messages_in_jetstream_until_a_sample_frees_room(cfg, bus):
    for i in range(5):
        await bus.publish(bus.subjects.trajectories, make_group(f"g{i}"))
    async with running_replay(with_replay(cfg, capacity_groups=3)) as (replay, stub):
        await until(lambda: stats_are(replay, size=3), "a full buffer")
        info = await bus.js.consumer_info(bus.subjects.stream("traj"), CONSUMER)
        assert (info.num_pending, info.num_ack_pending) == (2, 0)
        batch = await stub.Sample(replay_pb2.SampleRequest(step=0, prompts_per_step=3, max_staleness=0))
        assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
        await until(lambda: stats_are(replay, size=2), "the rest after room was freed")


async def test_sample_over_grpc_evicts_stale_groups_and_announces_them(cfg, bus):
    stale: asyncio.Queue = asyncio.Queue()

    async def on_stale(msg):
        await stale.put(types_pb2.StaleGroups.FromString(msg.data))

    await bus.nc.subscribe(bus.subjects.stale, cb=on_stale)
    async with running_replay(cfg) as (replay, stub):
        for i, version in enumerate([0, 2, 3]):
            await bus.publish(bus.subjects.trajectories, make_group(f"g{i}", version))
        await until(lambda: stats_are(replay, size=3), "three groups")
        request = replay_pb2.SampleRequest(step=3, prompts_per_step=2, max_staleness=1)
        first = await stub.Sample(request)
        again = await stub.Sample(request)
        stats = await stub.Stats(replay_pb2.StatsRequest())
        committed = await stub.Commit(replay_pb2.CommitRequest(step=3))
    assert first.ready and first.stale_dropped == 1 and [g.group_id for g in first.groups] == ["g1", "g2"]
    assert again == replay_pb2.SampleResponse(ready=True, groups=first.groups)
    assert list((await stale.get()).group_ids) == ["g0"]
    assert (stats.size, stats.stale_dropped, stats.capacity) == (0, 1, cfg.replay.capacity_groups)
    assert committed.deleted_groups == 2


async def test_bad_sample_request_gets_invalid_argument(cfg):
    bad = [dict(step=-1, prompts_per_step=1), dict(step=0, prompts_per_step=0),
           dict(step=0, prompts_per_step=1, max_staleness=-1)]
    async with running_replay(cfg) as (_, stub):
        for fields in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Sample(replay_pb2.SampleRequest(**fields))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        await stub.Commit(replay_pb2.CommitRequest(step=4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Sample(replay_pb2.SampleRequest(step=4, prompts_per_step=1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "committed" in err.value.details()

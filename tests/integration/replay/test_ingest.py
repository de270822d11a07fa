"""Ingest through real NATS JetStream into real Redis, and Sample/Stats/Commit over gRPC in process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from conftest import report, running_replay, until, with_grpo
from groups import make_group
from services.common.pb.flywheel.v1 import replay_pb2, types_pb2
from services.replay.ingest import CONSUMER, REASON_HEADER, TRUNCATED_HEADER
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


async def test_a_malformed_message_at_max_payload_is_dead_lettered_cut_to_fit_its_headers(cfg, bus):
    """Its bytes plus the dead letter's headers pass max_payload: published whole, the server would close
    replay's connection and ingest would fail (found by tests/integration/security/test_fuzz.py)."""
    dead: asyncio.Queue = asyncio.Queue()

    async def on_dead(msg):
        await dead.put(msg)

    await bus.nc.subscribe(bus.subjects.dead_letter, cb=on_dead)
    huge = b"\xff" * (bus.nc.max_payload - 100)
    async with running_replay(cfg) as (replay, _):
        await bus.js.publish(bus.subjects.trajectories, huge)
        await bus.publish(bus.subjects.trajectories, make_group("good"))
        await until(lambda: stats_are(replay, size=1, dead_lettered=1), "the dead letter and the good group")
        letter = await dead.get()
    assert letter.headers[TRUNCATED_HEADER] == str(len(huge)) and huge.startswith(letter.data)
    assert letter.headers[REASON_HEADER].startswith("undecodable")


async def test_full_buffer_leaves_messages_in_jetstream_until_a_sample_frees_room(cfg, bus):
    for i in range(5):
        await bus.publish(bus.subjects.trajectories, make_group(f"g{i}"))
    async with running_replay(with_grpo(with_replay(cfg, capacity_groups=3), num_prompts_per_step=3,
                                        max_staleness=0)) as (replay, stub):
        await until(lambda: stats_are(replay, size=3), "a full buffer")
        info = await bus.js.consumer_info(bus.subjects.stream("traj"), CONSUMER)
        # The surplus is in JetStream, undelivered or, once, delivered to a fetch whose client-side timeout fired
        # first on a loaded machine (nats-py then drops them; the server redelivers after ack_wait): never stored.
        assert info.num_pending + info.num_ack_pending == 2 and await stats_are(replay, size=3)
        batch = await stub.Sample(replay_pb2.SampleRequest(step=0, prompts_per_step=3, max_staleness=0))
        assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
        await until(lambda: stats_are(replay, size=2), "the rest after room was freed")


async def stale_events(bus) -> asyncio.Queue:
    """The StaleGroups replay announces to the controller, as they arrive."""
    stale: asyncio.Queue = asyncio.Queue()

    async def on_stale(msg):
        await stale.put(types_pb2.StaleGroups.FromString(msg.data))

    await bus.nc.subscribe(bus.subjects.stale, cb=on_stale)
    return stale


async def test_sample_over_grpc_evicts_stale_groups_and_announces_them(cfg, bus):
    stale = await stale_events(bus)
    async with running_replay(with_grpo(cfg, num_prompts_per_step=2, max_staleness=1)) as (replay, stub):
        for i, version in enumerate([0, 2, 3]):
            await bus.publish(bus.subjects.trajectories, make_group(f"g{i}", version))
        await until(lambda: stats_are(replay, size=3), "three groups")
        await report(bus, replay, step=2)  # the trainer is past steps 0..2, so step 3 is next
        request = replay_pb2.SampleRequest(step=3, prompts_per_step=2, max_staleness=1)
        first = await stub.Sample(request)
        again = await stub.Sample(request)
        stats = await stub.Stats(replay_pb2.StatsRequest())
        await report(bus, replay, step=3, checkpoint_step=3)
        committed = await stub.Commit(replay_pb2.CommitRequest(step=3))
    assert first.ready and first.stale_dropped == 1 and [g.group_id for g in first.groups] == ["g1", "g2"]
    assert again == replay_pb2.SampleResponse(ready=True, groups=first.groups)
    assert list((await stale.get()).group_ids) == ["g0"]
    assert (stats.size, stats.stale_dropped, stats.capacity) == (0, 1, cfg.replay.capacity_groups)
    assert committed.deleted_groups == 2


async def test_bad_sample_request_gets_invalid_argument(cfg, bus):
    bad = [dict(step=-1, prompts_per_step=1), dict(step=0, prompts_per_step=0),
           dict(step=0, prompts_per_step=1, max_staleness=-1)]
    async with running_replay(with_grpo(cfg, num_prompts_per_step=1, max_staleness=0)) as (replay, stub):
        for fields in bad:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Sample(replay_pb2.SampleRequest(**fields))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        await report(bus, replay, step=4, checkpoint_step=4)
        await stub.Commit(replay_pb2.CommitRequest(step=4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Sample(replay_pb2.SampleRequest(step=4, prompts_per_step=1))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "committed" in err.value.details()


async def test_stale_groups_wait_in_jetstream_until_the_controller_consumes_them(cfg, bus):
    async with running_replay(with_grpo(cfg, num_prompts_per_step=1, max_staleness=1)) as (replay, stub):
        for i, version in enumerate([0, 3]):
            await bus.publish(bus.subjects.trajectories, make_group(f"g{i}", version))
        await until(lambda: stats_are(replay, size=2), "two groups")
        await report(bus, replay, step=2)
        await stub.Sample(replay_pb2.SampleRequest(step=3, prompts_per_step=1, max_staleness=1))  # evicts g0
    received: asyncio.Queue = asyncio.Queue()

    async def controller(msg) -> None:  # the controller was down during the eviction; it starts now
        await received.put(types_pb2.StaleGroups.FromString(msg.data))

    sub = await bus.consume(bus.subjects.stale, "controller-stale", controller)
    stale = await asyncio.wait_for(received.get(), 30)
    await sub.unsubscribe()
    assert list(stale.group_ids) == ["g0"]


async def test_groups_evicted_by_a_replay_that_died_before_announcing_them_are_announced_after_its_restart(cfg, bus):
    """The eviction and the outbox write are one Redis script; the publish comes after. Here the store evicts
    (as a replay killed right after would leave it), and the next replay's start announces the ids once."""
    stale = await stale_events(bus)
    async with running_replay(with_grpo(cfg, num_prompts_per_step=1, max_staleness=1)) as (replay, _):
        for i, version in enumerate([0, 1, 5]):
            await bus.publish(bus.subjects.trajectories, make_group(f"g{i}", version))
        await until(lambda: stats_are(replay, size=3), "three groups")
    # No replay runs now: the store alone evicts g0 and g1 for step 5, with nobody to announce them.
    result = await replay.store.sample(5, 1, 1)
    assert result.stale_ids == ["g0", "g1"] and stale.empty()
    async with running_replay(with_grpo(cfg, num_prompts_per_step=1, max_staleness=1)) as (restarted, _):
        announced = await asyncio.wait_for(stale.get(), 10)
        async def trimmed() -> bool:  # the trim follows the publish's ack, so it may trail the delivery
            return await restarted.store.stale_outbox() == []

        await until(trimmed, "the outbox trimmed once announced")
    assert list(announced.group_ids) == ["g0", "g1"] and stale.empty()


async def test_a_sample_that_is_not_ready_waits_for_ingest_and_answers_once_the_batch_is_stored(cfg, bus):
    async with running_replay(with_grpo(cfg, num_prompts_per_step=2, max_staleness=0)) as (replay, stub):
        request = replay_pb2.SampleRequest(step=0, prompts_per_step=2, max_staleness=0)
        early = await stub.Sample(request)  # nothing stored: not ready, after holding at most SAMPLE_HOLD_S
        assert not early.ready and early.missing == 2
        waiting = asyncio.ensure_future(stub.Sample(request))  # held by replay while the groups arrive
        await asyncio.sleep(0.05)
        for i in range(2):
            await bus.publish(bus.subjects.trajectories, make_group(f"g{i}"))
        batch = await waiting
    assert batch.ready and [g.group_id for g in batch.groups] == ["g0", "g1"]

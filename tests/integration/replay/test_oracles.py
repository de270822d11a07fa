"""The chaos ledger's oracles (tests/integration/oracles.py) catch the faults they exist for: each test runs the real
replay service on real NATS JetStream and Redis, the test publishing groups as rollout does and sampling as the
trainer does, then injects one fault into Redis behind replay's back and expects the oracle to name it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis

from conftest import report, running_replay, until, with_grpo
from groups import make_group
from services.common.pb.flywheel.v1 import replay_pb2, types_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/integration: oracles.py
from oracles import StepRecords, balance, lost, read_ledger, stream_state  # noqa: E402

GROUPS = 8
PER_STEP = 2
STEPS = 3
K = 3


@pytest.fixture
def cfg(cfg):
    return with_grpo(cfg, num_prompts_per_step=PER_STEP, max_staleness=K)


@pytest.fixture
def client(cfg):
    c = redis.Redis.from_url(cfg.addresses.redis_url)
    yield c
    c.close()


async def _run(cfg, bus, client) -> tuple[set[str], dict[int, list[str]], StepRecords]:
    """Publish GROUPS groups (each acked by JetStream), let replay store them, train STEPS steps; the published
    ids, the trainer's consumed batches and the step records polled after each Sample."""
    published = {f"g{i}" for i in range(GROUPS)}
    records = StepRecords(client, cfg.run.name)
    trained: dict[int, list[str]] = {}
    async with running_replay(cfg) as (replay, stub):
        for gid in sorted(published):
            await bus.publish(bus.subjects.trajectories, make_group(gid))

        async def all_acked() -> bool:
            s = await stream_state(cfg.addresses.nats_url, cfg.run.name)
            return s.stored == GROUPS and (s.unacked, s.ack_pending) == (0, 0)

        await until(all_acked, "replay to ack every group")
        for step in range(STEPS):
            batch = await stub.Sample(replay_pb2.SampleRequest(step=step, prompts_per_step=PER_STEP, max_staleness=K))
            assert batch.ready
            trained[step] = [g.group_id for g in batch.groups]
            records.poll()
            await report(bus, replay, step)
    return published, trained, records


async def _quiet_state(cfg, client):
    return await stream_state(cfg.addresses.nats_url, cfg.run.name), read_ledger(client, cfg.run.name)


async def test_the_oracles_balance_on_a_run_without_faults(cfg, bus, client):
    published, trained, records = await _run(cfg, bus, client)
    stream, ledger = await _quiet_state(cfg, client)
    assert (lost(published, ledger), balance(stream, ledger), records.problems(STEPS, trained)) == (set(), [], [])
    assert len(ledger.unchosen) == GROUPS - STEPS * PER_STEP  # the ledger read something, not nothing


async def test_a_group_dropped_after_its_ack_is_caught(cfg, bus, client):
    published, _, _ = await _run(cfg, bus, client)
    p = f"flywheel:{{{cfg.run.name}}}:replay:"
    [victim, *_] = sorted(read_ledger(client, cfg.run.name).unchosen)
    client.delete(p + "g:" + victim)  # the group is gone, and so is every index that named it
    for index in ("fifo", "ver", "fin"):
        client.zrem(p + index, victim)
    stream, ledger = await _quiet_state(cfg, client)
    assert lost(published, ledger) == {victim}
    assert any("dropped after replay acked them" in p for p in balance(stream, ledger)), balance(stream, ledger)


async def test_a_record_whose_payload_vanished_is_caught(cfg, bus, client):
    await _run(cfg, bus, client)
    client.delete(f"flywheel:{{{cfg.run.name}}}:replay:c:1:0")
    stream, ledger = await _quiet_state(cfg, client)
    assert any("step 1's group 0" in p and "no payload" in p for p in balance(stream, ledger))


async def test_a_batch_served_twice_is_caught(cfg, bus, client):
    published, trained, records = await _run(cfg, bus, client)
    p = f"flywheel:{{{cfg.run.name}}}:replay:"
    client.rpush(f"{p}choice:{STEPS}", *trained[0])  # step STEPS recorded with step 0's groups
    client.zadd(p + "steps", {str(STEPS): STEPS})
    records.poll()
    trained[STEPS] = trained[0]
    problems = records.problems(STEPS + 1, trained)
    assert any(f"served in step 0 and again in step {STEPS}" in p for p in problems), problems


async def test_a_rewritten_step_record_is_caught(cfg, bus, client):
    published, trained, records = await _run(cfg, bus, client)
    p = f"flywheel:{{{cfg.run.name}}}:replay:"
    other = sorted(read_ledger(client, cfg.run.name).unchosen)[0]
    client.lset(f"{p}choice:1", 0, other)  # step 1's record now names a group the trainer never got in step 1
    records.poll()
    problems = records.problems(STEPS, trained)
    assert any("step 1's record changed" in p for p in problems), problems
    fresh = StepRecords(client, cfg.run.name)  # a reader that only ever saw the rewritten record
    fresh.first = dict(records.first)
    fresh.first[1] = [i.decode() for i in client.lrange(f"{p}choice:1", 0, -1)]
    assert any("step 1 is not the one replay recorded" in p for p in fresh.problems(STEPS, trained))


async def test_a_completion_whose_version_tags_run_backwards_is_caught(cfg, bus, client):
    await _run(cfg, bus, client)
    key = f"flywheel:{{{cfg.run.name}}}:replay:c:1:0"
    group = types_pb2.TrajectoryGroup.FromString(client.get(key))
    group.completions[0].version_start, group.completions[0].version_end = 3, 2  # an older weight loaded in flight
    group.version_start = min(c.version_start for c in group.completions)
    client.set(key, group.SerializeToString())
    stream, ledger = await _quiet_state(cfg, client)
    assert any("step 1's group 0" in p and "to an older 2" in p for p in balance(stream, ledger)), ledger.damaged

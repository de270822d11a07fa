"""Crashes lose and duplicate nothing: a kill -9 of the replay service mid-ingest, and a
kill -9 of Redis (AOF) after groups were acked. Every group id is counted end to end."""

from __future__ import annotations

import signal
import subprocess
import sys

import yaml
from redis.asyncio import Redis

from conftest import running_replay, until, with_grpo
from groups import make_group
from services.common.infra import free_port, start_redis
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc
from services.common.server import channel
from services.replay.ingest import CONSUMER
from services.replay.store import key_prefix


NEVER_STALE = 1 << 20


def start_service(cfg, config_file) -> subprocess.Popen:
    config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return subprocess.Popen([sys.executable, "-m", "services.replay.main", "--config", str(config_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def sample_everything(stub, total: int, per_step: int) -> list[str]:
    """Ask steps 0, 1, ... until every group has been handed out; returns ids in batch order."""
    seen: list[str] = []
    for step in range(total // per_step):
        request = replay_pb2.SampleRequest(step=step, prompts_per_step=per_step, max_staleness=NEVER_STALE)
        batch = await stub.Sample(request)
        assert batch.ready
        seen += [g.group_id for g in batch.groups]
    return seen


async def test_replay_service_kill_9_mid_ingest_loses_and_duplicates_nothing(cfg, bus, tmp_path):
    total = 240
    cfg = cfg.model_copy(update={"addresses": cfg.addresses.model_copy(update={"replay": f"127.0.0.1:{free_port()}"}),
                                 "replay": cfg.replay.model_copy(update={"fetch_batch": 8})})
    cfg = with_grpo(cfg, num_prompts_per_step=16, max_staleness=NEVER_STALE)
    ids = [f"g{i:03d}" for i in range(total)]
    for gid in ids:
        await bus.publish(bus.subjects.trajectories, make_group(gid, tokens=256))
    redis = Redis.from_url(cfg.addresses.redis_url)
    stored = lambda: redis.zcard(key_prefix(cfg.run.name) + "fifo")  # noqa: E731

    service = start_service(cfg, tmp_path / "replay.yaml")
    await until(lambda: _at_least(stored, total // 5), "ingest to start")
    service.send_signal(signal.SIGKILL)
    service.wait()
    killed_at = await stored()

    service = start_service(cfg, tmp_path / "replay.yaml")
    try:
        await until(lambda: _at_least(stored, total), "the restarted service to ingest the rest")
        info = await bus.js.consumer_info(bus.subjects.stream("traj"), CONSUMER)
        async with channel(cfg.addresses.replay) as ch:
            stub = replay_pb2_grpc.ReplayServiceStub(ch)
            stats = await stub.Stats(replay_pb2.StatsRequest())
            seen = await sample_everything(stub, total, per_step=16)
    finally:
        service.send_signal(signal.SIGTERM)
        returncode = service.wait(timeout=5)  # the service must honour SIGTERM promptly
        await redis.aclose()
    assert killed_at < total, "the kill landed after ingest had finished; nothing was tested"
    assert sorted(seen) == ids  # each group exactly once across all batches
    assert (info.num_pending, stats.size) == (0, total)
    assert returncode == 0


async def _at_least(count, n: int) -> bool:
    return await count() >= n


async def test_redis_kill_9_with_aof_loses_nothing_that_was_acked(cfg, bus, redis_server, tmp_path):
    ids = [f"g{i:03d}" for i in range(60)]
    async with running_replay(with_grpo(cfg, num_prompts_per_step=10, max_staleness=NEVER_STALE)) as (replay, stub):
        for gid in ids[:40]:
            await bus.publish(bus.subjects.trajectories, make_group(gid))
        await until(lambda: _all_acked(bus, replay, 40), "40 groups stored and acked")
        # A process crash: what Redis acknowledged was already written to the AOF (the OS holds
        # it even before the everysec fsync), so nothing acked may be missing after the restart.
        redis_server.stop(kill=True)
        restarted = start_redis(tmp_path / "redis", port=redis_server.port)
        try:
            for gid in ids[40:]:
                await bus.publish(bus.subjects.trajectories, make_group(gid))
            await until(lambda: _all_acked(bus, replay, 60), "ingest to resume after the restart")
            seen = await sample_everything(stub, len(ids), per_step=10)
        finally:
            restarted.stop()
    assert sorted(seen) == ids


async def _all_acked(bus, replay, n: int) -> bool:
    info = await bus.js.consumer_info(bus.subjects.stream("traj"), CONSUMER)
    return info.num_pending == 0 and info.num_ack_pending == 0 and (await replay.store.size()) == n


PREDECESSOR = """
import asyncio, sys
from services.common.bus import Bus
from services.common.config import load_config
from services.replay.ingest import Ingest

async def main():
    cfg = load_config(sys.argv[1])
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="replay")
    msgs = await (await Ingest(bus, None, cfg.replay).subscribe()).fetch(1, timeout=20)
    print(*[m.metadata.sequence.stream for m in msgs], flush=True)
    await asyncio.sleep(3600)  # killed here, between fetch and ack

asyncio.run(main())
"""


async def test_a_restarted_replay_stores_at_once_what_its_killed_predecessor_fetched_and_did_not_ack(cfg, bus,
                                                                                                    tmp_path):
    """A replay killed between fetch and ack (here: replay's own consumer code in a process SIGKILLed right after
    its fetch) leaves the group delivered and unacked. With ack_wait an hour, only the restarted replay handing it
    back can bring the group to Redis while the test waits; JetStream's consumer state is the oracle."""
    cfg = cfg.model_copy(update={"replay": cfg.replay.model_copy(update={"ack_wait_s": 3600.0})})
    cfg = with_grpo(cfg, num_prompts_per_step=1, max_staleness=NEVER_STALE)
    (tmp_path / "replay.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    await bus.publish(bus.subjects.trajectories, make_group("held"))
    predecessor = subprocess.Popen([sys.executable, "-c", PREDECESSOR, str(tmp_path / "replay.yaml")],
                                   stdout=subprocess.PIPE, text=True)
    fetched = predecessor.stdout.readline().split()
    predecessor.send_signal(signal.SIGKILL)
    predecessor.wait()
    before = await bus.js.consumer_info(bus.subjects.stream("traj"), CONSUMER)
    assert fetched == ["1"] and before.num_ack_pending == 1  # the kill left the group held, not acked

    async with running_replay(cfg) as (replay, stub):
        await until(lambda: _all_acked(bus, replay, 1), "the held group to be stored and acked")
        batch = await stub.Sample(replay_pb2.SampleRequest(step=0, prompts_per_step=1, max_staleness=NEVER_STALE))
    assert [g.group_id for g in batch.groups] == ["held"]

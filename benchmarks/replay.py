"""Replay throughput: the service path beside raw redis-py writing and reading the same bytes.

    .venv/bin/python benchmarks/replay.py [--groups 320] [--per-step 8]

Groups are realistic: 16 completions x 1,000 tokens with per-token logprobs and masks.
Ingest: groups are first published to JetStream (publish rate printed for context), then the
replay service (a child process, as deployed) drains them into Redis; the rate is groups
stored per second from the first stored group to the last. The raw baseline pipelines SETs
of the same payloads. Sample: batches of --per-step groups over gRPC against pipelined GETs.
Results are kept in docs/replay.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.bus import Bus  # noqa: E402
from services.common.config import FlywheelConfig  # noqa: E402
from services.common.infra import free_port, start_nats, start_redis  # noqa: E402
from services.common.pb.flywheel.v1 import replay_pb2, replay_pb2_grpc, types_pb2  # noqa: E402
from services.common.server import channel  # noqa: E402
from services.replay.store import key_prefix  # noqa: E402


def make_payloads(n: int, samples: int = 16, tokens: int = 1000) -> list[bytes]:
    rng = random.Random(0)
    completions = [types_pb2.Completion(
        token_ids=[rng.randrange(150_000) for _ in range(tokens)], generated_mask=[True] * tokens,
        generation_logprobs=[-rng.random() * 5 for _ in range(tokens)], version_start=0, version_end=0,
        reward=rng.random()) for _ in range(samples)]
    template = types_pb2.TrajectoryGroup(prompt_token_ids=list(range(200)), completions=completions, env_name="math")
    out = []
    for i in range(n):
        template.group_id = f"bench-{i:06d}"
        out.append(template.SerializeToString())
    return out


def raw_ingest(client: redis.Redis, payloads: list[bytes], chunk: int = 16) -> float:
    start = time.perf_counter()
    for i in range(0, len(payloads), chunk):
        pipe = client.pipeline(transaction=False)
        for j, payload in enumerate(payloads[i:i + chunk], start=i):
            pipe.set(f"raw:g:{j}", payload)
        pipe.execute()
    return len(payloads) / (time.perf_counter() - start)


def raw_sample(client: redis.Redis, n: int, per_step: int) -> float:
    start = time.perf_counter()
    for step in range(n // per_step):
        pipe = client.pipeline(transaction=False)
        for j in range(step * per_step, (step + 1) * per_step):
            pipe.get(f"raw:g:{j}")
        pipe.execute()
    return (n // per_step) / (time.perf_counter() - start)


async def publish(cfg: FlywheelConfig, payloads: list[bytes], window: int = 32) -> float:
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="bench")
    start = time.perf_counter()
    for i in range(0, len(payloads), window):
        await asyncio.gather(*(bus.js.publish(bus.subjects.trajectories, p) for p in payloads[i:i + window]))
    rate = len(payloads) / (time.perf_counter() - start)
    await bus.close()
    return rate


def service_ingest(client: redis.Redis, cfg: FlywheelConfig, n: int) -> float:
    fifo = key_prefix(cfg.run.name) + "fifo"
    while client.zcard(fifo) == 0:
        time.sleep(0.001)
    start, first = time.perf_counter(), client.zcard(fifo)
    while client.zcard(fifo) < n:
        time.sleep(0.002)
    return (n - first) / (time.perf_counter() - start)


async def service_sample(cfg: FlywheelConfig, n: int, per_step: int) -> float:
    async with channel(cfg.addresses.replay) as ch:
        stub = replay_pb2_grpc.ReplayServiceStub(ch)
        start = time.perf_counter()
        for step in range(n // per_step):
            batch = await stub.Sample(replay_pb2.SampleRequest(step=step, prompts_per_step=per_step,
                                                               max_staleness=1 << 20))
            assert batch.ready and len(batch.groups) == per_step
        return (n // per_step) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=320)
    parser.add_argument("--per-step", type=int, default=8)
    args = parser.parse_args()
    payloads = make_payloads(args.groups)
    mb = sum(map(len, payloads)) / 1e6
    print(f"{args.groups} groups, {mb / args.groups * 1000:.0f} kB each, {mb:.0f} MB in all")
    with tempfile.TemporaryDirectory() as tmp:
        nats, red = start_nats(Path(tmp) / "nats"), start_redis(Path(tmp) / "redis")
        cfg = FlywheelConfig.model_validate({
            "run": {"name": "bench"}, "replay": {"capacity_groups": args.groups},
            "addresses": {"nats_url": nats.url, "redis_url": red.url, "replay": f"127.0.0.1:{free_port()}"}})
        (Path(tmp) / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        client = redis.Redis.from_url(red.url)
        service = None
        try:
            raw_in = raw_ingest(client, payloads)
            raw_out = raw_sample(client, args.groups, args.per_step)
            published = asyncio.run(publish(cfg, payloads))
            service = subprocess.Popen([sys.executable, "-m", "services.replay.main", "--config",
                                        str(Path(tmp) / "cfg.yaml")], stderr=subprocess.DEVNULL)
            svc_in = service_ingest(client, cfg, args.groups)
            svc_out = asyncio.run(service_sample(cfg, args.groups, args.per_step))
        finally:
            if service:
                service.terminate()
                service.wait()
            nats.stop()
            red.stop()
    print(f"{'':28}{'service':>12}{'raw redis-py':>14}{'ratio':>8}")
    print(f"{'ingest groups/s':28}{svc_in:12.0f}{raw_in:14.0f}{svc_in / raw_in:8.2f}")
    print(f"{'ingest MB/s':28}{svc_in * mb / args.groups:12.0f}{raw_in * mb / args.groups:14.0f}")
    print(f"{'sample batches/s (' + str(args.per_step) + ' groups)':28}{svc_out:12.0f}{raw_out:14.0f}"
          f"{svc_out / raw_out:8.2f}")
    print(f"(JetStream publish, for context: {published:.0f} groups/s)")


if __name__ == "__main__":
    main()

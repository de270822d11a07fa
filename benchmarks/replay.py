"""Replay throughput: the service path beside raw redis-py writing and reading the same bytes.

    .venv/bin/python benchmarks/replay.py [--groups 320] [--per-step 8] [--rounds 5]

Groups are realistic: 16 completions x 1,000 tokens with per-token logprobs and masks.
Each round measures both sides back to back, since on a shared machine the load drifts:
- ingest: raw pipelines SETs of the round's payloads; then the round's groups are published to
  JetStream and a fresh replay service (a child process, as deployed) drains them into Redis
  (rate: groups stored per second from the first stored group to the last); then the same groups
  go through a bare consumer (a child process that only fetches from JetStream as replay does, SETs
  the bytes and acks: no checks, no Lua, no spans), the floor of any Python consumer of the stream;
- sample: one step at a time, raw pipelines GETs of --per-step payloads, then the service answers
  a Sample of --per-step groups over gRPC; each side's time is summed over the steps, so both see
  the same load.
The ratios printed last are the medians of the rounds' ratios. Two more measurements say where the
rest goes: the CPU per ingested group of each process on either side (from /proc, so Linux only),
and, in the same turns as the Samples, a bare gRPC server in its own process that only returns the
same reply bytes: a Sample is a Redis read followed by such a reply, so the service's rate is at most
bare / (raw + bare) of raw's.
Neither side parses what it delivers: raw hands the caller the payload bytes, the service client
the SampleResponse bytes that carry the same payloads (parsing them costs the caller the same on
either side; the time for one batch is printed for context). The responses are parsed and checked
after the timing. Results are kept in docs/replay.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import redis
import redis.asyncio
import yaml
from nats.js.api import AckPolicy, ConsumerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.bus import Bus  # noqa: E402
from services.common.config import FlywheelConfig  # noqa: E402
from services.common.infra import die_with_parent, free_port, start_nats, start_redis  # noqa: E402
from services.common.pb.flywheel.v1 import replay_pb2, types_pb2  # noqa: E402
from services.common.server import channel  # noqa: E402
from services.replay.store import key_prefix  # noqa: E402

NEVER_STALE = 1 << 20


def make_payloads(n: int, samples: int = 16, tokens: int = 1000, prefix: str = "bench") -> list[bytes]:
    rng = random.Random(0)
    completions = [types_pb2.Completion(
        token_ids=[rng.randrange(150_000) for _ in range(tokens)], generated_mask=[True] * tokens,
        generation_logprobs=[-rng.random() * 5 for _ in range(tokens)], version_start=0, version_end=0,
        reward=rng.random()) for _ in range(samples)]
    template = types_pb2.TrajectoryGroup(prompt_token_ids=list(range(200)), completions=completions, env_name="math")
    out = []
    for i in range(n):
        template.group_id = f"{prefix}-{i:06d}"
        out.append(template.SerializeToString())
    return out


def raw_ingest(client: redis.Redis, keys: list[str], payloads: list[bytes], chunk: int = 16) -> float:
    start = time.perf_counter()
    for i in range(0, len(payloads), chunk):
        pipe = client.pipeline(transaction=False)
        for key, payload in zip(keys[i:i + chunk], payloads[i:i + chunk]):
            pipe.set(key, payload)
        pipe.execute()
    return len(payloads) / (time.perf_counter() - start)


def raw_sample(client: redis.Redis, keys: list[str]) -> list[bytes]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return pipe.execute()


async def publish(cfg: FlywheelConfig, payloads: list[bytes], window: int = 32) -> float:
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="bench")
    start = time.perf_counter()
    for i in range(0, len(payloads), window):
        await asyncio.gather(*(bus.js.publish(bus.subjects.trajectories, p) for p in payloads[i:i + window]))
    rate = len(payloads) / (time.perf_counter() - start)
    await bus.close()
    return rate


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stored_rate(stored: Callable[[], int], n: int, pids: dict[str, int]) -> tuple[float, dict]:
    """Groups stored per second from the first stored group to the last (`stored` counts them), and the CPU ms
    per group of `pids` over the same window."""
    while stored() == 0:
        time.sleep(0.001)
    start, first, cpu = time.perf_counter(), stored(), {k: cpu_s(pid) for k, pid in pids.items()}
    while stored() < n:
        time.sleep(0.002)
    seconds = time.perf_counter() - start
    return (n - first) / seconds, {k: (cpu_s(pid) - cpu[k]) / (n - first) * 1e3 for k, pid in pids.items()}


BARE_COUNT = "bare:stored"


def bare_consume(nats_url: str, redis_url: str, run: str, n: int, fetch: int) -> None:
    """The least a consumer of the trajectory stream does: fetch as replay does (`fetch` at a time, the next fetch
    overlapping the last write), SET each payload, ack each message after the write. No decode, no checks, no
    idempotence, no spans: a floor for replay's ingest, in its own process as the service is."""

    async def write(client: redis.asyncio.Redis, msgs: list) -> None:
        pipe = client.pipeline(transaction=False)
        for msg in msgs:
            pipe.set(f"bare:{msg.metadata.sequence.stream}", msg.data)
        pipe.incrby(BARE_COUNT, len(msgs))
        await pipe.execute()
        for msg in msgs:
            await msg.ack()

    async def consume() -> None:
        bus = await Bus.connect(nats_url, run, name="bare")
        stream = bus.subjects.stream("traj")
        await bus.js.add_consumer(stream, ConsumerConfig(durable_name="bare", ack_policy=AckPolicy.EXPLICIT,
                                                         filter_subject=bus.subjects.trajectories))
        sub = await bus.js.pull_subscribe_bind(durable="bare", stream=stream)
        client = redis.asyncio.Redis.from_url(redis_url)
        writing, fetched = None, 0
        while fetched < n:
            msgs = await sub.fetch(min(fetch, n - fetched), timeout=30)
            fetched += len(msgs)
            if writing:
                await writing
            writing = asyncio.create_task(write(client, msgs))
        await writing
        await client.aclose()
        await bus.close()

    asyncio.run(consume())


def serve_reply(port: int, reply: bytes) -> None:
    """A gRPC server that answers every call with `reply` and does nothing else (no Redis): what a Sample costs
    over gRPC alone. Runs in its own process, as the service does."""

    async def answer(request: bytes, context) -> bytes:
        return reply

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        handler = grpc.unary_unary_rpc_method_handler(answer)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Reply", {"Get": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def both_sample(cfg: FlywheelConfig, client: redis.Redis, keys: list[str], steps: range,
                      per_step: int) -> tuple[dict[str, float], list[bytes]]:
    """Batches per second of raw, the service and bare gRPC with the same reply, taken in turns; the replies."""
    async with channel(cfg.addresses.replay) as ch:
        # No response_deserializer: the caller gets the response bytes, as the raw side gets the payloads.
        sample = ch.unary_unary("/flywheel.v1.ReplayService/Sample",
                                request_serializer=replay_pb2.SampleRequest.SerializeToString)

        def request(step: int) -> replay_pb2.SampleRequest:
            return replay_pb2.SampleRequest(step=step, prompts_per_step=per_step, max_staleness=NEVER_STALE)

        replies = [await sample(request(steps[0]))]  # opens the channel: not timed
        port = free_port()
        bare_server = multiprocessing.get_context("spawn").Process(target=serve_reply, args=(port, replies[0]))
        bare_server.start()
        try:
            async with channel(f"127.0.0.1:{port}") as bare_ch:
                bare = bare_ch.unary_unary("/bench.Reply/Get")
                await asyncio.wait_for(bare_ch.channel_ready(), 30)
                await bare(b"")
                seconds = {"raw": 0.0, "service": 0.0, "bare": 0.0}
                for i, step in enumerate(steps[1:], start=1):
                    t0 = time.perf_counter()
                    assert all(raw_sample(client, keys[i * per_step:(i + 1) * per_step]))
                    t1 = time.perf_counter()
                    replies.append(await sample(request(step)))
                    t2 = time.perf_counter()
                    await bare(b"")
                    t3 = time.perf_counter()
                    for side, took in (("raw", t1 - t0), ("service", t2 - t1), ("bare", t3 - t2)):
                        seconds[side] += took
        finally:
            bare_server.terminate()
            bare_server.join()
        return {side: (len(steps) - 1) / took for side, took in seconds.items()}, replies


def check_replies(replies: list[bytes], per_step: int, sent: set[bytes]) -> float:
    """Every reply is a full batch of groups that were published; returns the seconds to parse one reply."""
    start = time.perf_counter()
    batches = [replay_pb2.SampleResponse.FromString(reply) for reply in replies]
    parse_s = (time.perf_counter() - start) / len(replies)
    for batch in batches:
        assert batch.ready and len(batch.groups) == per_step, (batch.ready, batch.missing, len(batch.groups))
        assert all(group.SerializeToString() in sent for group in batch.groups)
    return parse_s


def run_round(r: int, tmp: Path, cfg: FlywheelConfig, client: redis.Redis, servers: dict[str, int],
              args) -> dict[str, float]:
    payloads = make_payloads(args.groups, prefix=f"bench{r}")
    keys = [f"raw:{r}:g:{i}" for i in range(args.groups)]
    cpu = {"client": os.times(), "redis": cpu_s(servers["redis"])}
    out = {"raw_in": raw_ingest(client, keys, payloads)}
    after = os.times()
    out["cpu_raw_client"] = (after.user + after.system - cpu["client"].user - cpu["client"].system) / args.groups * 1e3
    out["cpu_raw_redis"] = (cpu_s(servers["redis"]) - cpu["redis"]) / args.groups * 1e3
    out["published"] = asyncio.run(publish(cfg, payloads))
    service = subprocess.Popen([sys.executable, "-m", "services.replay.main", "--config", str(tmp / "cfg.yaml")],
                               stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    fifo = key_prefix(cfg.run.name) + "fifo"
    try:
        out["svc_in"], cpu = stored_rate(lambda: client.zcard(fifo), args.groups, {"replay": service.pid, **servers})
        out |= {f"cpu_svc_{k}": v for k, v in cpu.items()}
        first = r * (args.groups // args.per_step)  # steps go on across rounds (replay keeps the recorded ones)
        rates, replies = asyncio.run(both_sample(cfg, client, keys, range(first, first + args.groups // args.per_step),
                                                 args.per_step))
        out |= {"raw_out": rates["raw"], "svc_out": rates["service"], "bare_out": rates["bare"]}
    finally:
        service.terminate()
        service.wait()
    client.delete(*keys)
    out["parse_ms"] = check_replies(replies, args.per_step, set(payloads)) * 1000

    bare_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": f"bare{r}"})})
    asyncio.run(publish(bare_cfg, payloads))
    bare = multiprocessing.get_context("spawn").Process(target=bare_consume, args=(
        cfg.addresses.nats_url, cfg.addresses.redis_url, bare_cfg.run.name, args.groups, cfg.replay.fetch_batch))
    bare.start()
    try:
        out["bare_in"], cpu = stored_rate(lambda: int(client.get(BARE_COUNT) or 0), args.groups,
                                          {"bare": bare.pid, **servers})
        out |= {f"cpu_bare_{k}": v for k, v in cpu.items()}
    finally:
        bare.join(60)
        bare.terminate()
    client.delete(BARE_COUNT, *(f"bare:{seq}" for seq in range(1, args.groups + 1)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=320, help="groups per round")
    parser.add_argument("--per-step", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.groups % args.per_step:  # a partial batch would stay in replay and be sampled in the next round
        parser.error("--groups must be a multiple of --per-step")
    mb = sum(map(len, make_payloads(1))) / 1e6
    print(f"{args.groups} groups per round, {mb * 1000:.0f} kB each, {mb * args.groups:.0f} MB per round, "
          f"{args.rounds} rounds")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        nats, red = start_nats(Path(tmp) / "nats"), start_redis(Path(tmp) / "redis")
        cfg = FlywheelConfig.model_validate({  # replay serves batches of the run's shape only
            "run": {"name": "bench"}, "replay": {"capacity_groups": args.groups},
            "grpo": {"num_prompts_per_step": args.per_step,
                     "async_grpo": {"enabled": True, "max_trajectory_age_steps": NEVER_STALE}},
            "environments": [{"name": "toy", "kind": "toy_copy"}],
            "addresses": {"nats_url": nats.url, "redis_url": red.url, "replay": f"127.0.0.1:{free_port()}"}})
        (Path(tmp) / "cfg.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        client = redis.Redis.from_url(red.url)
        try:
            for r in range(args.rounds):
                rounds.append(run_round(r, Path(tmp), cfg, client, {"redis": red.proc.pid, "nats": nats.proc.pid},
                                        args))
        finally:
            nats.stop()
            red.stop()
    print(f"{'round':8}{'ingest groups/s service':>25}{'raw':>8}{'ratio':>8}"
          f"{'sample batches/s service':>27}{'raw':>8}{'ratio':>8}")
    for r, x in enumerate(rounds):
        print(f"{r:<8}{x['svc_in']:25.0f}{x['raw_in']:8.0f}{x['svc_in'] / x['raw_in']:8.2f}"
              f"{x['svc_out']:27.0f}{x['raw_out']:8.0f}{x['svc_out'] / x['raw_out']:8.2f}")
    med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    ratio_in = statistics.median(x["svc_in"] / x["raw_in"] for x in rounds)
    ratio_out = statistics.median(x["svc_out"] / x["raw_out"] for x in rounds)
    print(f"{'median':8}{med['svc_in']:25.0f}{med['raw_in']:8.0f}{ratio_in:8.2f}"
          f"{med['svc_out']:27.0f}{med['raw_out']:8.0f}{ratio_out:8.2f}")
    print(f"ingest MB/s (median): service {med['svc_in'] * mb:.0f}, raw {med['raw_in'] * mb:.0f}")
    print(f"ingest CPU ms per group (median): raw: client {med['cpu_raw_client']:.3f} + redis {med['cpu_raw_redis']:.3f}"
          f"; service: replay {med['cpu_svc_replay']:.3f} + redis {med['cpu_svc_redis']:.3f} "
          f"+ nats {med['cpu_svc_nats']:.3f}")
    # The service path's ingest needs replay's one thread for each group, and every process on the path a share
    # of the cores: its rate cannot pass either bound, whatever the overlap.
    cores = len(os.sched_getaffinity(0))  # the cores this run may use (Linux, as cpu_s)
    by_thread = 1e3 / med["cpu_svc_replay"]
    by_cores = cores * 1e3 / (med["cpu_svc_replay"] + med["cpu_svc_redis"] + med["cpu_svc_nats"])
    print(f"ingest bound from that CPU: replay's thread {by_thread:.0f} groups/s, {cores} cores over the path "
          f"{by_cores:.0f} groups/s: at most {min(by_thread, by_cores) / med['raw_in']:.2f} of raw's median")
    bare_ratio = statistics.median(x["bare_in"] / x["raw_in"] for x in rounds)
    print(f"ingest floor, a bare consumer of the same stream (fetch, SET, ack; nothing else), in the same rounds: "
          f"{med['bare_in']:.0f} groups/s, {bare_ratio:.2f} of raw; replay reaches "
          f"{statistics.median(x['svc_in'] / x['bare_in'] for x in rounds):.2f} of it")
    print(f"bare consumer CPU ms per group (median): consumer {med['cpu_bare_bare']:.3f} + redis "
          f"{med['cpu_bare_redis']:.3f} + nats {med['cpu_bare_nats']:.3f}")
    print(f"sample over bare gRPC (a server that only returns the same reply bytes, no Redis), in the same turns: "
          f"{med['bare_out']:.0f} batches/s, {statistics.median(x['bare_out'] / x['raw_out'] for x in rounds):.2f} of raw")
    # A unary Sample reads the batch from Redis (raw's work) and only then replies (bare gRPC's work): its time is at
    # least the sum of the two, so its rate is at most bare / (raw + bare) of raw's.
    serial = statistics.median(x["bare_out"] / (x["raw_out"] + x["bare_out"]) for x in rounds)
    print(f"sample bound from those two: a Redis read, then the reply: at most {serial:.2f} of raw")
    print(f"for context: JetStream publish {med['published']:.0f} groups/s; parsing one Sample reply "
          f"({args.per_step} groups) {med['parse_ms']:.1f} ms, which either side's caller would pay")

if __name__ == "__main__":
    main()

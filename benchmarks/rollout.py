"""Rollout service tokens/s beside the same engine called directly, for the hf and vllm backends.

    python benchmarks/rollout.py [--groups 192] [--max-new-tokens 32] [--backends hf vllm] [--repeats 2]

Both sides use the same config, engine, weights (version 0, delivered over gloo as the trainer does),
toy_copy prompts, G, sampling, torch threads and `cfg.groups_in_flight` groups at a time (by default a step's
prompts; rollout.max_groups_in_flight=N sets it):
- direct: this process builds the engine (`make_engine`) and awaits `engine.generate([prompt] * G)` for the
  groups, at most groups_in_flight at once;
- service: NATS, the environment service and the rollout service run as processes (LocalStack's). This
  process plays the trainer (the version-0 sync, announced on NATS), the controller (the groups published
  on the work queue once the worker reports WeightLoaded, as the controller leases only then) and replay
  (it acks each stored TrajectoryGroup). The clock runs from the first publish to the last TrajectoryGroup
  received, so the service side also pays for NATS, the environment's Step and the trajectory publish.
Printed per pair: generated tokens/s of each side, their ratio (service / direct), the load average, and each
side's CPU seconds per 1,000 generated tokens by process over the timed window (vLLM's engine-core and worker
processes included). The CPU split tells the service's extra CPU apart from time its engine sat idle.
Results: docs/vllm.md and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from services.common.bus import Bus
from services.common.config import FlywheelConfig, load_config
from services.common.modeling import load_policy
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.server import channel
from services.common.structs import to_struct
from services.common.weights import WeightSender
from services.environment.base import make_environment
from services.local import LocalStack
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids


def weights(cfg: FlywheelConfig):
    model, _ = load_policy(cfg.policy, cfg.run.seed)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def cpu_seconds(roots: dict[str, int], alone: tuple[str, ...] = ()) -> dict[str, float]:
    """user + system CPU seconds so far of each named process and, apart, of its children (vLLM's engine core
    and worker) by process name; not of the children of those named in `alone`."""
    out: dict[str, float] = {}
    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            out[name] = sum(root.cpu_times()[:2])
            for child in [] if name in alone else root.children(recursive=True):
                key = f"{name}/{child.name()}"
                out[key] = out.get(key, 0.0) + sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


async def direct(cfg: FlywheelConfig, rows: list[dict]) -> tuple[int, float, dict[str, float]]:
    engine = make_engine(cfg, "bench-direct")
    await engine.start()
    announced: list = []
    sender = WeightSender(backend="gloo", publish=announced.append)
    sync = threading.Thread(target=sender.sync, args=(0, ["bench-direct"], weights(cfg)), kwargs={"timeout_s": 120})
    sync.start()
    while not announced:
        await asyncio.sleep(0.01)
    await engine.load_weights(announced[-1].fields(), timeout_s=120)
    sync.join()
    sampling = Sampling.resolve(cfg.policy.generation)
    slots, g = asyncio.Semaphore(cfg.groups_in_flight), cfg.grpo.num_generations_per_prompt

    async def group(row) -> int:
        async with slots:
            outs = await engine.generate([prompt_token_ids(engine.tokenizer, row["messages"])] * g, sampling)
            return sum(len(o.token_ids) for o in outs)

    roots = {"engine": os.getpid()}  # this process is the engine's (hf) or its client (vllm)
    cpu0, t0 = cpu_seconds(roots), time.perf_counter()
    tokens = sum(await asyncio.gather(*(group(r) for r in rows)))
    seconds, cpu = time.perf_counter() - t0, cpu_delta(cpu0, cpu_seconds(roots))
    sender.close()
    await engine.close()
    return tokens, seconds, cpu


async def service(stack: LocalStack, rows: list[dict]) -> tuple[int, float, dict[str, float]]:
    cfg = stack.cfg
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="bench", security=cfg.security)
    async with channel(cfg.addresses.environment, security=cfg.security) as ch:
        await environment_pb2_grpc.EnvironmentServiceStub(ch).Register(
            environment_pb2.RegisterRequest(name="toy", kind="toy_copy"), wait_for_ready=True, timeout=120)
    workers: set[str] = set()
    loaded = asyncio.Event()

    async def on_heartbeat(msg) -> None:
        workers.add(types_pb2.RolloutHeartbeat.FromString(msg.data).worker_id)

    async def on_loaded(msg) -> None:
        if types_pb2.WeightLoaded.FromString(msg.data).version == 0:
            loaded.set()

    heartbeats = await bus.nc.subscribe(bus.subjects.heartbeat, cb=on_heartbeat)
    confirmations = await bus.nc.subscribe(bus.subjects.weights_loaded, cb=on_loaded)
    while not workers:  # the rollout service is up once it beats
        await asyncio.sleep(0.1)
    loop = asyncio.get_running_loop()
    sender = WeightSender(backend="gloo", publish=lambda a: asyncio.run_coroutine_threadsafe(
        bus.publish(bus.subjects.weights_announce, types_pb2.WeightAnnouncement(**a.fields())), loop).result(10))
    result = await asyncio.to_thread(sender.sync, 0, sorted(workers), weights(cfg), timeout_s=180)
    assert result.members_ok, "the rollout service did not load version 0"
    await asyncio.wait_for(loaded.wait(), timeout=60)  # the controller leases only after WeightLoaded

    done, tokens = asyncio.Event(), [0, 0]

    async def on_trajectory(msg) -> None:
        traj = types_pb2.TrajectoryGroup.FromString(msg.data)
        tokens[0] += sum(sum(c.generated_mask) for c in traj.completions)
        tokens[1] += 1
        await msg.ack()
        if tokens[1] == len(rows):
            done.set()

    sub = await bus.js.subscribe(bus.subjects.trajectories, cb=on_trajectory, manual_ack=True)
    roots = {"rollout": stack.children.procs["rollout-0"].pid, "environment": stack.children.procs["environment"].pid,
             "nats": stack.nats.proc.pid, "bench": os.getpid()}  # bench's children are the stack's
    cpu0, t0 = cpu_seconds(roots, alone=("bench",)), time.perf_counter()
    for i, row in enumerate(rows):
        gid = uuid.uuid4().hex
        await bus.publish(bus.subjects.work, types_pb2.PromptGroup(
            group_id=gid, prompt_id=f"toy/{i}", env_name="toy", target_step=0, max_turns=1,
            messages=[types_pb2.ChatMessage(**m) for m in row["messages"]], metadata=to_struct(row["metadata"]),
            num_generations=cfg.grpo.num_generations_per_prompt, leased_at_unix_ns=time.time_ns()), msg_id=gid)
    await asyncio.wait_for(done.wait(), timeout=1800)
    seconds, cpu = time.perf_counter() - t0, cpu_delta(cpu0, cpu_seconds(roots, alone=("bench",)))
    await sub.unsubscribe()
    await heartbeats.unsubscribe()
    await confirmations.unsubscribe()
    sender.close()
    await bus.close()
    return tokens[0], seconds, cpu


def run(backend: str, groups: int, max_new_tokens: int, service_first: bool, overrides: list[str]) -> dict:
    cfg = load_config(None, [f"policy.generation.backend={backend}", f"policy.generation.max_new_tokens={max_new_tokens}",
                             f"policy.max_total_sequence_length={16 + max_new_tokens}", *overrides])
    rows = make_environment("toy_copy").prompts(groups, seed=cfg.run.seed, offset=0)
    sides = {}
    for side in (("service", "direct") if service_first else ("direct", "service")):
        load = os.getloadavg()[0]
        if side == "direct":
            sides[side] = (*asyncio.run(direct(cfg, rows)), load)
            continue
        with tempfile.TemporaryDirectory() as tmp, LocalStack(cfg, Path(tmp)) as stack:
            stack.children.start("environment", "environment", stack.config_path)
            stack.children.start("rollout-0", "rollout", stack.config_path)
            sides[side] = (*asyncio.run(service(stack, rows)), load)
    return sides


def report(backend: str, sides: dict) -> None:
    (d_tokens, d_s, d_cpu, d_load), (s_tokens, s_s, s_cpu, s_load) = sides["direct"], sides["service"]
    d_rate, s_rate = d_tokens / d_s, s_tokens / s_s
    print(f"{backend:5s} direct {d_rate:8.1f} tok/s ({d_tokens} tokens, load {d_load:.1f})   "
          f"service {s_rate:8.1f} tok/s ({s_tokens} tokens, load {s_load:.1f})   ratio {s_rate / d_rate:.2f}")
    for side, tokens, seconds, cpu in (("direct", d_tokens, d_s, d_cpu), ("service", s_tokens, s_s, s_cpu)):
        per_k = {name: 1000 * v / tokens for name, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0.005}
        print(f"      {side:7s} cpu s per 1k tokens {sum(per_k.values()):.3f} (wall {1000 * seconds / tokens:.3f}): "
              + "  ".join(f"{name} {v:.3f}" for name, v in per_k.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=192)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    p.add_argument("--repeats", type=int, default=2, help="pairs per backend; the order alternates (load drifts)")
    p.add_argument("overrides", nargs="*", help="config overrides for both sides, e.g. rollout.max_groups_in_flight=8")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the rollout service sets it
    for backend in args.backends:
        for i in range(args.repeats):
            report(backend, run(backend, args.groups, args.max_new_tokens, i % 2 == 1, args.overrides))


if __name__ == "__main__":
    main()

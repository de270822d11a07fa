"""Async (max_staleness = k) vs synchronous (k = 0) GRPO, side by side, same machine, same config.

    python benchmarks/async_vs_sync.py [--steps 60] [--k 1] [--no-pin] [key=value ...]

Runs the full local stack (NATS, Redis, five services) twice and prints the mean step time (after
warm-up), steps/s, the ratio, and how close the ratio comes to the ideal.

The ideal comes from the synchronous run, where nothing overlaps: each step is G, the time the trainer spends
getting its batch (its Sample calls, which in a synchronous run hold while the lease, generation, environment
and ingest run), plus T, all the rest, which is the trainer's own work (batch, logprobs, optimizer, weight
sync, and its checkpoints, step reports and Commits). An asynchronous step can be no shorter than max(G, T), so the speed-up is bounded by
(G + T) / max(G, T), and "achieved" is the measured speed-up over that bound. A second bound comes from
the async run's own CPU use: a core gives at most one CPU-second per second, so a step can be no shorter
than the CPU seconds per step of the busiest core (pinned) or of all processes over the cores (not pinned).

Overlap needs the two sides to have their own CPUs. On a 2-core machine an unpinned rollout and trainer
compete for the same cores, so by default the trainer gets CPU 1 to itself and every other process of the
stack (rollout, environment, replay, controller, NATS, Redis) shares CPU 0, in both runs: the generation
side is everything the trainer waits for. (Pinning only rollout and trainer, with the rest floating, put
the light services on the trainer's core and made its steps ~50% slower.) --no-pin leaves the scheduler alone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from services.common.config import load_config
from services.local import LocalStack
from stack_cpu import cpu_per_step

WARMUP = 5
TRAINER_CPUS, OTHER_CPUS = {1}, {0}
"""The trainer's core, and the one every other child shares."""


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread the process has now; threads it starts later inherit the affinity of their creator."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def run(steps: int, k: int, overrides: list[str], pinned: bool) -> dict[str, float]:
    cfg = load_config(None, [f"grpo.max_num_steps={steps}", f"grpo.async_grpo.enabled={k > 0}",
                             f"grpo.async_grpo.max_trajectory_age_steps={k}", *overrides])
    with tempfile.TemporaryDirectory() as tmp, LocalStack(cfg, Path(tmp)) as stack:
        stack.start_services()
        if pinned:
            for name, proc in stack.children.procs.items():
                pin(proc.pid, TRAINER_CPUS if name == "trainer" else OTHER_CPUS)
        per_step = cpu_per_step(stack, WARMUP, steps)
        rows = stack.wait_for(lambda rows: len(rows) >= steps, f"{steps} steps", timeout_s=3600)
    timed = rows[WARMUP:]
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    step_s = mean("timing/train/total_step_time")
    wait_s = mean("timing/train/replay_wait") + mean("timing/train/replay")
    return {"step_s": step_s, "train_s": step_s - wait_s, "wait_s": wait_s,
            "staleness": mean("train/staleness_mean"),
            "reward_last10": sum(r["train/reward_mean"] for r in rows[-10:]) / 10,
            "cpu_trainer_s": per_step["trainer"],
            "cpu_rest_s": sum(v for name, v in per_step.items() if name != "trainer")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="leave CPU placement to the scheduler")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        parser.error("pinning needs 2 CPUs; pass --no-pin")
    sync = run(args.steps, 0, args.overrides, args.pin)
    async_ = run(args.steps, args.k, args.overrides, args.pin)
    print(f"trainer on CPUs {sorted(TRAINER_CPUS)}, the rest of the stack on {sorted(OTHER_CPUS)}" if args.pin
          else "not pinned")
    print(f"{'':<14}{'step s':>9}{'own s':>9}{'Sample s':>10}{'staleness':>11}{'reward@end':>12}")
    for name, r in (("sync (k=0)", sync), (f"async (k={args.k})", async_)):
        print(f"{name:<14}{r['step_s']:9.3f}{r['train_s']:9.3f}{r['wait_s']:10.3f}{r['staleness']:11.2f}"
              f"{r['reward_last10']:12.3f}")
    speedup = sync["step_s"] / async_["step_s"]
    g, t = sync["wait_s"], sync["train_s"]  # getting the batch, and the trainer's own work, not overlapped
    ideal = (g + t) / max(g, t)
    print(f"speed-up async/sync: {speedup:.2f}x steps/s (the trainer's Sample calls {g:.3f} s -> {async_['wait_s']:.3f} s)")
    print(f"ideal bound (G + T) / max(G, T) from the sync run: G {g:.3f} s, T {t:.3f} s -> {ideal:.2f}x; "
          f"achieved {speedup / ideal:.2f} of it")
    trainer_cpu, rest_cpu = async_["cpu_trainer_s"], async_["cpu_rest_s"]
    if args.pin:
        floor, how = max(trainer_cpu, rest_cpu), "the busier core"
    else:
        floor, how = (trainer_cpu + rest_cpu) / len(os.sched_getaffinity(0)), "all of it over the cores"
    cores = sync["step_s"] / floor
    print(f"CPU per step of the async run: trainer {trainer_cpu:.3f} s, the rest of the stack {rest_cpu:.3f} s; "
          f"a step takes at least {how}, {floor:.3f} s -> {cores:.2f}x; "
          f"achieved {speedup / min(ideal, cores):.2f} of the lower bound")


if __name__ == "__main__":
    main()

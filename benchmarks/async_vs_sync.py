"""Async (max_staleness = k) vs synchronous (k = 0) GRPO, side by side, same machine, same config.

    python benchmarks/async_vs_sync.py [--steps 60] [--k 1] [key=value ...]

Runs the full local stack (NATS, Redis, five services) twice and prints the mean step time
(after warm-up), steps/s, and the ratio. On a 2-core CPU machine the trainer and the rollout
worker share the cores, so overlap gains are bounded; the figure that matters on GPUs is the
same ratio with separate devices.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from services.common.config import load_config
from services.local import LocalStack

WARMUP = 5


def run(steps: int, k: int, overrides: list[str]) -> dict[str, float]:
    cfg = load_config(None, [f"grpo.max_num_steps={steps}", f"grpo.max_staleness={k}", *overrides])
    with tempfile.TemporaryDirectory() as tmp, LocalStack(cfg, Path(tmp)) as stack:
        stack.start_services()
        rows = stack.wait_for(lambda rows: len(rows) >= steps, f"{steps} steps", timeout_s=3600)
    timed = rows[WARMUP:]
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    return {"step_s": mean("timing/train/total_step_time"), "train_s": mean("timing/train/policy_training"),
            "wait_s": mean("timing/train/replay_wait"), "staleness": mean("train/staleness_mean"),
            "reward_last10": sum(r["train/reward_mean"] for r in rows[-10:]) / 10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sync = run(args.steps, 0, args.overrides)
    async_ = run(args.steps, args.k, args.overrides)
    print(f"{'':<14}{'step s':>9}{'train s':>9}{'wait s':>9}{'staleness':>11}{'reward@end':>12}")
    for name, r in ((f"sync (k=0)", sync), (f"async (k={args.k})", async_)):
        print(f"{name:<14}{r['step_s']:9.3f}{r['train_s']:9.3f}{r['wait_s']:9.3f}{r['staleness']:11.2f}"
              f"{r['reward_last10']:12.3f}")
    print(f"speed-up async/sync: {sync['step_s'] / async_['step_s']:.2f}x steps/s "
          f"(trainer wait for data {sync['wait_s']:.3f} s -> {async_['wait_s']:.3f} s)")


if __name__ == "__main__":
    main()

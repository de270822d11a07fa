"""Does the chaos run's fault schedule change what is learned? Final reward with and without faults, many seeds.

    python benchmarks/learning_under_faults.py [--seeds 10] [--steps 120] [--first-seed 1]

Each seed runs the default toy job twice through the chaos harness (tests/integration/chaos.py), in turns so
that the machine's load falls on both arms alike: once with no faults, once under that seed's schedule (every
process killed once, three paused). Both runs take `run.seed` = the seed, and both are audited (nothing lost
or trained twice). Printed: each run's mean reward over its last 10 steps, each arm's distribution, and an exact
permutation test of the difference in means (two-sided). Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from chaos import reward_rose, run_chaos  # noqa: E402

HIGH = 0.95
"""A run that ends at or above this learned the toy task; below it, the policy collapsed early (the low mode)."""


def permutation_p(a: list[float], b: list[float]) -> float:
    """Two-sided exact permutation test of mean(a) - mean(b): the share of relabellings at least as extreme."""
    pooled, n = a + b, len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    total = sum(pooled)
    extreme = count = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        left = sum(pooled[i] for i in chosen)
        diff = abs(left / n - (total - left) / len(b))
        extreme += diff >= observed - 1e-12
        count += 1
    return extreme / count


def one_run(seed: int, steps: int, faulted: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="flywheel-faults-") as tmp:
        faults = {} if faulted else {"killed": (), "paused": ()}
        run_chaos(Path(tmp), steps, seed, [f"run.seed={seed}"], **faults)
        return reward_rose(Path(tmp))[1]


def describe(name: str, rewards: list[float]) -> str:
    high = sum(r >= HIGH for r in rewards)
    return (f"{name}: mean {statistics.fmean(rewards):.3f}, median {statistics.median(rewards):.3f}, "
            f"{high}/{len(rewards)} at >= {HIGH}; sorted {[round(r, 3) for r in sorted(rewards)]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--first-seed", type=int, default=1)
    args = parser.parse_args()
    clean, faulted = [], []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for arm, rewards in ((False, clean), (True, faulted)):
            t0 = time.monotonic()
            rewards.append(one_run(seed, args.steps, arm))
            print(f"seed {seed} {'faults' if arm else 'clean '}: last 10 steps {rewards[-1]:.3f} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    print(describe("no faults", clean))
    print(describe("chaos schedule", faulted))
    print(f"difference in means {statistics.fmean(faulted) - statistics.fmean(clean):+.3f}, "
          f"exact permutation p = {permutation_p(clean, faulted):.3f}")


if __name__ == "__main__":
    main()

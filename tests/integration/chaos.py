"""Chaos: `flywheel up`'s stack (its supervisor included) under kill -9 and SIGSTOP at seeded random steps,
and a ledger that accounts for every group a rollout worker published.

    python tests/integration/chaos.py --steps 300 --rounds 3 --seed 1     # the soak; figures in docs/reliability.md

Each fault lands once the trainer has finished the fault's step. Kills hit every process of the run
(a rollout worker, environment, replay, controller, trainer, NATS, Redis); the supervisor restarts each.
Pauses (SIGSTOP, then SIGCONT after PAUSE_S) hold a rollout worker, the environment service or replay
longer than the trainer's 5 s liveness window. `inject` (faults.py) reports what /proc
shows each fault did. Once the run is done and quiet, the ledger checks, the way Jepsen audits a queue, what the
brokers hold (oracles.py), not what the services log about themselves:

- steps: replay's Redis record of each step's batch, read all through the run, covers each step 0..N-1 once,
  never changes once written, and puts no group in two steps; the trainer's consumed batches (batches.jsonl)
  are those records;
- staleness: step - version_start <= k for every trained group;
- nothing acknowledged lost: JetStream's trajectory stream holds nothing unacked, and every message it stored is
  accounted for in Redis (a stored group, unchosen, chosen or tombstoned; a duplicate; a dead letter); every id a
  rollout worker logged as published (it logs after JetStream's ack: the one per-id record of what was acked,
  since the work-queue stream drops acked messages) is in Redis's ledger.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from services.common.config import load_config  # noqa: E402
from services.local import LocalStack, read_metrics, read_restarts  # noqa: E402
from faults import Fault, Observed, inject  # noqa: E402
from oracles import StepRecords, balance, lost, read_ledger, read_stream_state  # noqa: E402

KILLED = ("rollout-0", "environment", "replay", "controller", "trainer", "nats", "redis")
PAUSED = ("rollout-0", "environment", "replay")
PUBLISHED = re.compile(r"group ([0-9a-f]{32}): published")


@dataclass(frozen=True, slots=True)
class Ledger:
    steps: int
    trained: int
    """Groups trained on, each exactly once."""
    published: int
    """Distinct group ids rollout workers logged as published."""
    stored: int
    """Messages JetStream's trajectory stream stored."""
    in_buffer: int
    """Groups still unchosen in replay at the end."""
    duplicates: int
    """Deliveries replay refused as already stored (a redelivery after a crash, a republish)."""
    restarts: int
    spanning: int
    """Completions in replay's records that were sampled across a weight update (in-flight updates)."""


def schedule(seed: int, steps: int, killed=KILLED, paused=PAUSED) -> list[Fault]:
    """Every kill and pause once, each at its own random step in [3, steps - 3), in step order."""
    rng = random.Random(seed)
    faults = [("kill", t) for t in killed] + [("pause", t) for t in paused]
    rng.shuffle(faults)
    at = sorted(rng.sample(range(3, steps - 3), len(faults)))
    return [Fault(step=s, action=a, target=t) for s, (a, t) in zip(at, faults)]


def run_chaos(run_dir: Path, steps: int, seed: int, overrides: list[str] = (), killed=KILLED,
              paused=PAUSED) -> tuple[list[Observed], Ledger]:
    """One run of `steps` steps under `schedule(seed, steps, killed, paused)`: what each fault did, and the
    audited ledger (AssertionError if unbalanced)."""
    cfg = load_config(None, [f"grpo.max_num_steps={steps}", "grpo.async_grpo.max_trajectory_age_steps=1",
                             "checkpointing.save_period=10", "weight_sync.timeout_s=10", *overrides])
    observed = []
    with LocalStack(cfg, run_dir) as stack, _redis(stack) as client:
        records, done = StepRecords(client, stack.cfg.run.name), threading.Event()
        poller = threading.Thread(target=_poll, args=(records, done), daemon=True)
        watcher = threading.Thread(target=records.monitor, args=(done,), daemon=True)
        stack.start_services()
        poller.start()
        watcher.start()
        for fault in schedule(seed, steps, killed, paused):
            stack.wait_for(lambda rows, n=fault.step: len(rows) >= n, f"step {fault.step}", timeout_s=300)
            observed.append(inject(stack, fault))
        stack.wait_for(lambda rows: len(rows) >= steps, f"{steps} steps", timeout_s=600)
        done.set()
        poller.join()
        watcher.join()
        return observed, audit(stack, client, records, steps, cfg.grpo.max_staleness)


def _poll(records: StepRecords, done: threading.Event) -> None:
    """Read replay's step records until the run is done; Redis being down (killed, restarting) only delays it."""
    while not done.is_set():
        try:
            records.poll()
        except redis.exceptions.RedisError:
            pass  # killed by the schedule: the supervisor restarts it from its AOF
        done.wait(0.2)


def _redis(stack: LocalStack) -> redis.Redis:
    return redis.Redis.from_url(stack.cfg.addresses.redis_url,
                                password=stack.cfg.security.redis_password.get_secret_value() or None)


def audit(stack: LocalStack, client: redis.Redis, records: StepRecords, steps: int, k: int,
          quiet_s: float = 60.0) -> Ledger:
    run_dir, run = stack.children.run_dir, stack.cfg.run.name
    batches = {b["step"]: b for b in map(json.loads, (run_dir / "batches.jsonl").read_text().splitlines())}
    records.poll()
    problems = records.problems(steps, {s: [g["id"] for g in b["groups"]] for s, b in batches.items()})
    assert not problems, "replay's step records: " + "; ".join(problems[:5])
    late = [(s, g) for s, b in batches.items() for g in b["groups"] if s - g["version_start"] > k]
    assert not late, f"groups staler than k={k}: {late[:3]}"

    deadline = time.monotonic() + quiet_s  # groups still in flight when the last step ended land meanwhile
    while True:
        published = _logged(run_dir.glob("logs/rollout-*.log"), PUBLISHED)
        stream, ledger = read_stream_state(stack.cfg.addresses.nats_url, run, stack.cfg.security), read_ledger(client, run)
        missing, unbalanced = lost(published, ledger), balance(stream, ledger)
        if not missing and not unbalanced:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(missing)} acknowledged groups are not in replay's Redis: {sorted(missing)[:5]}; "
                                 + "; ".join(unbalanced))
        time.sleep(1.0)
    trained = sum(len(ids) for ids in records.first.values())
    return Ledger(steps=steps, trained=trained, published=len(published), stored=stream.stored,
                  in_buffer=len(ledger.unchosen), duplicates=ledger.duplicates, restarts=len(read_restarts(run_dir)),
                  spanning=ledger.spanning)


def _logged(paths, pattern: re.Pattern) -> set[str]:
    ids: set[str] = set()
    for path in paths:
        for match in pattern.finditer(Path(path).read_text()):
            ids.update(match.group(1).split())
    return ids


def reward_rose(run_dir: Path) -> tuple[float, float]:
    """Mean reward of the first and the last 10 steps."""
    rows = read_metrics(run_dir)
    return (sum(r["train/reward_mean"] for r in rows[:10]) / 10, sum(r["train/reward_mean"] for r in rows[-10:]) / 10)


def main() -> None:
    parser = argparse.ArgumentParser(description="chaos soak: runs under random faults, each audited")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    totals = dict(faults=0, trained=0, published=0, stored=0, duplicates=0, restarts=0)
    for round_ in range(args.rounds):
        seed = args.seed + round_
        with tempfile.TemporaryDirectory(prefix="flywheel-chaos-") as tmp:
            t0 = time.monotonic()
            observed, ledger = run_chaos(Path(tmp), args.steps, seed)
            first, last = reward_rose(Path(tmp))
        faults = [o.fault for o in observed]
        assert all(o.happened for o in observed), [o for o in observed if not o.happened]
        print(f"round {round_ + 1} seed {seed}: {len(faults)} faults "
              f"({', '.join(f'{f.action} {f.target}@{f.step}' for f in faults)}); {ledger}; "
              f"reward {first:.3f} -> {last:.3f}; {time.monotonic() - t0:.0f} s", flush=True)
        totals["faults"] += len(faults)
        for key in ("trained", "published", "stored", "duplicates", "restarts"):
            totals[key] += getattr(ledger, key)
    print(f"total: {args.rounds} runs, {totals['faults']} faults, {totals['restarts']} restarts, "
          f"{totals['published']} published groups and {totals['stored']} stored messages all accounted for in Redis "
          f"({totals['trained']} trained once, {totals['duplicates']} duplicates refused); 0 lost, 0 trained twice")


if __name__ == "__main__":
    main()

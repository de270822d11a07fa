"""Chaos: `flywheel up`'s stack (its supervisor included) under kill -9 and SIGSTOP at seeded random steps,
and a ledger that accounts for every group a rollout worker published.

    python tests/integration/chaos.py --steps 300 --rounds 3 --seed 1     # the soak; figures in docs/reliability.md

Each fault lands once the trainer has finished the fault's step. Kills hit every process of the run
(a rollout worker, environment, replay, controller, trainer, NATS, Redis); the supervisor restarts each.
Pauses (SIGSTOP, then SIGCONT after PAUSE_S) hold a rollout worker, the environment service or replay
longer than the trainer's 5 s liveness window. Once the run is done and quiet, the ledger checks, the way
Jepsen audits a queue, that every acknowledged id is accounted for:

- steps: the trainer's record (batches.jsonl, rewritten on resume) has each step 0..N-1 exactly once;
- exactly once: no group id is in two steps' batches;
- staleness: step - version_start <= k for every trained group;
- nothing acknowledged lost: every id a rollout worker logged as published (it logs after JetStream's ack)
  was trained, is still in replay's buffer, or was evicted as stale and announced to the controller
  (replay logs the ids it announces); and no trained group was also evicted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.config import load_config  # noqa: E402
from services.local import LocalStack, read_metrics, read_restarts  # noqa: E402
from services.replay.store import key_prefix  # noqa: E402

KILLED = ("rollout-0", "environment", "replay", "controller", "trainer", "nats", "redis")
PAUSED = ("rollout-0", "environment", "replay")
PAUSE_S = 6.0
"""Longer than the trainer's liveness window (5 s): a paused worker is dropped from the sync and rejoins."""
PUBLISHED = re.compile(r"group ([0-9a-f]{32}): published")
ANNOUNCED = re.compile(r"stale groups evicted: ([0-9a-f ]+)")


@dataclass(frozen=True, slots=True)
class Fault:
    step: int
    """Steps the trainer has finished when the fault lands."""
    action: str
    """"kill" (SIGKILL) or "pause" (SIGSTOP, SIGCONT after PAUSE_S)."""
    target: str


@dataclass(frozen=True, slots=True)
class Ledger:
    steps: int
    trained: int
    """Groups trained on, each exactly once."""
    published: int
    """Distinct group ids rollout workers logged as published."""
    in_buffer: int
    """Published groups still unchosen in replay at the end."""
    evicted: int
    """Published groups evicted as stale (and announced)."""
    restarts: int


def schedule(seed: int, steps: int, killed=KILLED, paused=PAUSED) -> list[Fault]:
    """Every kill and pause once, each at its own random step in [3, steps - 3), in step order."""
    rng = random.Random(seed)
    faults = [("kill", t) for t in killed] + [("pause", t) for t in paused]
    rng.shuffle(faults)
    at = sorted(rng.sample(range(3, steps - 3), len(faults)))
    return [Fault(step=s, action=a, target=t) for s, (a, t) in zip(at, faults)]


def inject(stack: LocalStack, fault: Fault) -> None:
    pid = stack.children.procs[fault.target].pid
    if fault.action == "kill":
        os.kill(pid, signal.SIGKILL)
        return
    os.killpg(pid, signal.SIGSTOP)  # the service's whole process group (vLLM's engine core included)
    time.sleep(PAUSE_S)
    os.killpg(pid, signal.SIGCONT)


def run_chaos(run_dir: Path, steps: int, seed: int, overrides: list[str] = ()) -> tuple[list[Fault], Ledger]:
    """One run of `steps` steps under `schedule(seed, steps)`; the audited ledger (AssertionError if unbalanced)."""
    cfg = load_config(None, [f"grpo.max_num_steps={steps}", "grpo.async_grpo.max_trajectory_age_steps=1",
                             "checkpointing.save_period=10", "weight_sync.timeout_s=10", *overrides])
    faults = schedule(seed, steps)
    with LocalStack(cfg, run_dir) as stack:
        stack.start_services()
        for fault in faults:
            stack.wait_for(lambda rows, n=fault.step: len(rows) >= n, f"step {fault.step}", timeout_s=300)
            inject(stack, fault)
        stack.wait_for(lambda rows: len(rows) >= steps, f"{steps} steps", timeout_s=600)
        return faults, audit(stack, steps, cfg.grpo.max_staleness)


def audit(stack: LocalStack, steps: int, k: int, quiet_s: float = 60.0) -> Ledger:
    run_dir = stack.children.run_dir
    batches = [json.loads(line) for line in (run_dir / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == list(range(steps)), "a step was skipped or repeated"
    trained = [g["id"] for b in batches for g in b["groups"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    late = [(b["step"], g) for b in batches for g in b["groups"] if b["step"] - g["version_start"] > k]
    assert not late, f"groups staler than k={k}: {late[:3]}"

    deadline = time.monotonic() + quiet_s  # groups still in flight when the last step ended land meanwhile
    while True:
        published = _logged(run_dir.glob("logs/rollout-*.log"), PUBLISHED)
        evicted = _logged([run_dir / "logs" / "replay.log"], ANNOUNCED)
        buffered = _buffered(stack)
        lost = published - set(trained) - buffered - evicted
        if not lost:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(lost)} acknowledged groups are neither trained, buffered nor evicted: "
                                 f"{sorted(lost)[:5]}")
        time.sleep(1.0)
    assert not set(trained) & evicted, "a trained group was also evicted"
    return Ledger(steps=steps, trained=len(trained), published=len(published), in_buffer=len(buffered & published),
                  evicted=len(evicted & published), restarts=len(read_restarts(run_dir)))


def _logged(paths, pattern: re.Pattern) -> set[str]:
    ids: set[str] = set()
    for path in paths:
        for match in pattern.finditer(Path(path).read_text()):
            ids.update(match.group(1).split())
    return ids


def _buffered(stack: LocalStack) -> set[str]:
    """Ids stored in replay and not yet chosen (its `fifo` index), read from Redis directly."""
    client = redis.Redis.from_url(stack.cfg.addresses.redis_url, decode_responses=True,
                                  password=stack.cfg.security.redis_password.get_secret_value() or None)
    try:
        return set(client.zrange(key_prefix(stack.cfg.run.name) + "fifo", 0, -1))
    finally:
        client.close()


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
    totals = dict(faults=0, trained=0, published=0, evicted=0, restarts=0)
    for round_ in range(args.rounds):
        seed = args.seed + round_
        with tempfile.TemporaryDirectory(prefix="flywheel-chaos-") as tmp:
            t0 = time.monotonic()
            faults, ledger = run_chaos(Path(tmp), args.steps, seed)
            first, last = reward_rose(Path(tmp))
        print(f"round {round_ + 1} seed {seed}: {len(faults)} faults "
              f"({', '.join(f'{f.action} {f.target}@{f.step}' for f in faults)}); {ledger}; "
              f"reward {first:.3f} -> {last:.3f}; {time.monotonic() - t0:.0f} s", flush=True)
        totals["faults"] += len(faults)
        for key in ("trained", "published", "evicted", "restarts"):
            totals[key] += getattr(ledger, key)
    print(f"total: {args.rounds} runs, {totals['faults']} faults, {totals['restarts']} restarts, "
          f"{totals['published']} published groups all accounted for ({totals['trained']} trained once, "
          f"{totals['evicted']} evicted as stale and re-leased, the rest left in the buffer); 0 lost, 0 trained twice")


if __name__ == "__main__":
    main()

"""`flywheel up`: NATS, Redis and the five services as child processes on loopback.

It resolves the config (free ports filled in), writes it to the run directory, starts the
infrastructure and the services, prints one line per training step, and stops everything
on the last step, on Ctrl-C, or when a service dies (printing that service's log tail).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from services.common.bus import Bus
from services.common.config import FlywheelConfig, write_resolved
from services.common.infra import Server, child_env, free_port, start_nats, start_redis
from services.common.pb.flywheel.v1 import types_pb2

START_ORDER = ("environment", "replay", "controller", "trainer", "rollout")
STOP_TIMEOUT_S = 5.0


def _fresh_run_dir(requested: str | None) -> Path:
    run_dir = Path(requested or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} already holds a run (metrics.jsonl); pass a fresh --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


class Children:
    """The service processes, stopped together."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.metrics_ports: dict[str, int] = {}
        """Prometheus /metrics port of each child."""

    def start(self, name: str, service: str, config: Path, overrides: list[str] = ()) -> None:
        log = (self.run_dir / "logs" / f"{name}.log").open("w")
        self.metrics_ports[name] = free_port()
        overrides = [*overrides, f"telemetry.metrics_port={self.metrics_ports[name]}"]
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", service, "--config", str(config), *overrides],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)

    def dead(self) -> str | None:
        return next((n for n, p in self.procs.items() if p.poll() not in (None, 0)), None)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join((self.run_dir / "logs" / f"{name}.log").read_text().splitlines()[-lines:])


def read_metrics(run_dir: Path) -> list[dict]:
    """The trainer's metrics.jsonl rows so far (one per finished step)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _assign_ports(cfg: FlywheelConfig, nats: Server, redis: Server, run_dir: Path) -> FlywheelConfig:
    cfg = cfg.model_copy(deep=True)
    a = cfg.addresses
    a.nats_url, a.redis_url = nats.url, redis.url
    for service in ("controller", "environment", "replay", "rollout", "trainer"):
        setattr(a, service, f"127.0.0.1:{free_port()}")
    cfg.run.run_dir = str(run_dir)
    return cfg


class LocalStack:
    """NATS, Redis and every service on loopback; a context manager that stops them all."""

    def __init__(self, cfg: FlywheelConfig, run_dir: Path) -> None:
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.nats = start_nats(run_dir / "nats", log_file=(logs / "nats.log").open("w"))
        self.redis = start_redis(run_dir / "redis", log_file=(logs / "redis.log").open("w"))
        self.cfg = _assign_ports(cfg, self.nats, self.redis, run_dir)
        self.config_path = write_resolved(self.cfg, run_dir)
        self.children = Children(run_dir)

    def start_services(self) -> None:
        for service in START_ORDER:
            if service != "rollout":
                self.children.start(service, service, self.config_path)
        for i in range(self.cfg.rollout.num_workers):
            extra = [] if i == 0 else [f"addresses.rollout=127.0.0.1:{free_port()}"]
            self.children.start(f"rollout-{i}", "rollout", self.config_path, extra)

    def wait_for(self, done: Callable[[list[dict]], bool], what: str, timeout_s: float) -> list[dict]:
        """Metrics rows once `done(rows)`; raises if a service dies or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.children.dead()
            if dead:
                raise RuntimeError(f"{dead} died:\n{self.children.tail(dead)}")
            rows = read_metrics(self.children.run_dir)
            if done(rows):
                return rows
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}; "
                           f"{len(read_metrics(self.children.run_dir))} steps")

    def stop(self) -> None:
        self.children.stop()
        self.nats.stop()
        self.redis.stop()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_local(cfg: FlywheelConfig, config_path: str | None, run_dir_arg: str | None) -> int:
    run_dir = _fresh_run_dir(run_dir_arg or cfg.run.run_dir or None)
    with LocalStack(cfg, run_dir) as stack:
        cfg = stack.cfg
        print(f"flywheel up: run dir {run_dir}\n  nats {stack.nats.url}  redis {stack.redis.url}  "
              f"controller {cfg.addresses.controller}", flush=True)
        try:
            stack.start_services()
            code = asyncio.run(_follow(cfg, stack.children))
        except KeyboardInterrupt:
            print("\ninterrupted: stopping services", flush=True)
            code = 130
    _summary(cfg, run_dir)
    return code


async def _follow(cfg: FlywheelConfig, children: Children) -> int:
    """Print progress until the final step report or a child dies."""
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="launcher")
    reports: asyncio.Queue = asyncio.Queue()

    async def on_step(msg) -> None:
        await reports.put(types_pb2.StepReport.FromString(msg.data))

    await bus.nc.subscribe(bus.subjects.train_step, cb=on_step)
    started = time.monotonic()
    try:
        while True:
            dead = children.dead()
            if dead:
                print(f"\n{dead} exited with code {children.procs[dead].returncode}; its log ends:\n"
                      f"{children.tail(dead)}", file=sys.stderr, flush=True)
                return 1
            try:
                report = await asyncio.wait_for(reports.get(), 1.0)
            except asyncio.TimeoutError:
                continue
            print(_progress_line(cfg, report, time.monotonic() - started), flush=True)
            if report.final:
                return 0
    finally:
        await bus.close()


def _progress_line(cfg: FlywheelConfig, report: types_pb2.StepReport, elapsed: float) -> str:
    m = report.metrics
    step_s = m["timing/train/total_step_time"]
    tokens = m["train/mean_gen_tokens_per_sample"] * m["train/num_samples"]
    return (f"step {report.step + 1:>4}/{cfg.grpo.max_num_steps}  reward {m['train/reward_mean']:.3f}  "
            f"staleness {m['train/staleness_mean']:.2f}  tok/s {tokens / max(step_s, 1e-9):7.0f}  "
            f"sync {1000 * m['timing/train/weight_sync']:5.1f} ms  step {step_s:.2f} s  [{elapsed:5.0f}s]")


PARTS = [("generation", "timing/train/generation"), ("environment", "timing/train/environment"),
         ("replay", "timing/train/replay"), ("training", "timing/train/policy_training"),
         ("weight sync", "timing/train/weight_sync")]


def _summary(cfg: FlywheelConfig, run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    if not rows:
        print("no training steps finished", flush=True)
        return

    def mean(key: str, rs=rows) -> float:
        return sum(r[key] for r in rs) / len(rs)

    workers = cfg.rollout.num_workers
    step = mean("timing/train/total_step_time")
    parts = {name: mean(key) / (workers if name in ("generation", "environment") else 1) for name, key in PARTS}
    first, last = rows[:10], rows[-10:]
    print(f"\nsummary: {len(rows)} steps, max_staleness={cfg.grpo.max_staleness}, {workers} rollout worker(s)\n"
          f"  reward: first 10 steps {mean('train/reward_mean', first):.3f} -> last 10 steps "
          f"{mean('train/reward_mean', last):.3f}\n  mean step time {step:.3f} s =", flush=True)
    for name, value in parts.items():
        print(f"    {name:<12} {value:7.3f} s", flush=True)
    remainder = step - sum(parts.values())
    print(f"    {'remainder':<12} {remainder:7.3f} s  control plane: NATS hops, leasing, queueing"
          + ("  (negative: rollout overlapped training)" if remainder < 0 else ""), flush=True)
    print(f"  metrics: {run_dir / 'metrics.jsonl'}", flush=True)

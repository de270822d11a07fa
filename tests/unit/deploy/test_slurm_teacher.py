"""deploy/slurm and a distillation run: make_sbatch.py gives the teacher servers a het group of their own (one task,
one GPU per replica), launch.sh starts each replica as an srun step of its own there (teacher_task.sh, on its node,
with its index on the node) before rollout and writes every replica's host:port into the resolved config's
teacher.addresses; a config that names its teacher servers gets no group. The real job, where one replica is killed
and restarts alone, runs in tests/deploy/test_slurm_job.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm import SLURM, _dry_run, _flywheel_args, _sbatch_groups

from services.cli import build_parser
from services.common.config import load_config

ROOT = Path(__file__).resolve().parents[3]
TEACHER_TASK = SLURM / "teacher_task.sh"
CONFIG = "tests/fixtures/nemo_rl/examples/configs/distillation_math.yaml"
EDITS = ["policy.generation.colocated.enabled=false",  # the two edits docs/nemo_rl_mapping.md lists
         "policy.dtensor_cfg.context_parallel_size=1"]
TINY = ("environments: [{name: toy, kind: toy_copy}, {name: rm, kind: reward_model, dataset: rows.jsonl}]\n"
        "env: {reward_model: {model_name: tiny}}\ndistillation: {}\nteacher: {model_name: tiny}\n")


def _make_sbatch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "deploy/slurm/make_sbatch.py", *args, "-o", "-"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", [TEACHER_TASK, SLURM / "task_gpus.sh"], ids=lambda p: p.name)
def test_bash_syntax(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_distillation_job_gets_a_het_group_of_teacher_replicas_one_gpu_each():
    run = _make_sbatch(CONFIG, *EDITS)
    assert run.returncode == 0, run.stderr
    *_, teacher = groups = _sbatch_groups(run.stdout)
    assert len(groups) == 4 and {"--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=1"} <= set(teacher)
    assert "FLYWHEEL_TEACHER_GROUP=${FLYWHEEL_TEACHER_GROUP:-3}" in run.stdout
    cpus = next(d for d in teacher if d.startswith("--cpus-per-task="))  # each replica's step asks for the same
    assert f"FLYWHEEL_TEACHER_CPUS=${{FLYWHEEL_TEACHER_CPUS:-{cpus.split('=')[1]}}}" in run.stdout
    run = _make_sbatch(CONFIG, *EDITS, "teacher.num_replicas=4", "--teacher-nodes", "2")
    assert run.returncode == 0, run.stderr
    assert {"--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2"} <= set(_sbatch_groups(run.stdout)[-1])
    assert "FLYWHEEL_TEACHER_PER_NODE=${FLYWHEEL_TEACHER_PER_NODE:-2}" in run.stdout


def test_teacher_servers_named_by_address_get_no_group_and_uneven_replicas_are_refused():
    run = _make_sbatch(CONFIG, *EDITS, "teacher.addresses=[node9:50057]")
    assert run.returncode == 0, run.stderr
    assert len(_sbatch_groups(run.stdout)) == 3 and "FLYWHEEL_TEACHER_GROUP" not in run.stdout
    run = _make_sbatch(CONFIG, *EDITS, "teacher.num_replicas=3", "--teacher-nodes", "2")
    assert run.returncode == 2 and "teacher.num_replicas 3 does not spread evenly over --teacher-nodes 2" in run.stderr


def test_the_teacher_group_follows_the_reward_models_on_a_cpu_job(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    run = _make_sbatch(str(tmp_path / "tiny.yaml"), "--cpu")
    assert run.returncode == 0, run.stderr
    groups = _sbatch_groups(run.stdout)
    assert len(groups) == 5 and "--ntasks-per-node=1" in groups[4] and "--ntasks=1" in groups[3]
    assert not any(d.startswith("--gpus") for g in groups for d in g)
    assert "FLYWHEEL_REWARD_MODEL_GROUP=${FLYWHEEL_REWARD_MODEL_GROUP:-3}" in run.stdout
    assert "FLYWHEEL_TEACHER_GROUP=${FLYWHEEL_TEACHER_GROUP:-4}" in run.stdout


def test_launch_starts_each_teacher_replica_as_a_step_of_its_own_at_the_address_the_config_lists(tmp_path):
    (tmp_path / "tiny.yaml").write_text("environments: [{name: toy, kind: toy_copy}]\ndistillation: {}\n"
                                        "teacher: {model_name: tiny, num_replicas: 4}\n")
    plan, run_dir = _dry_run(tmp_path, env={
        "FLYWHEEL_CONFIG": str(tmp_path / "tiny.yaml"), "FLYWHEEL_TEACHER_GROUP": "3", "FLYWHEEL_TEACHER_CPUS": "6",
        "FLYWHEEL_TEACHER_PER_NODE": "2", "FLYWHEEL_TEACHER_HOSTS": "t1 t2", "FLYWHEEL_TEACHER_PORT_BASE": "6000"})
    teachers = [f"teacher-{k}" for k in range(4)]
    assert list(plan) == ["nats", "redis", *teachers, "environment", "replay", "controller", "trainer", "rollout"]
    addresses = load_config(run_dir / "config.yaml").teacher.addresses
    assert addresses == ["t1:6000", "t1:6001", "t2:6000", "t2:6001"]
    for name, address in zip(teachers, addresses, strict=True):
        srun, task = plan[name][:plan[name].index("env")], plan[name][plan[name].index("env"):]
        assert srun[:2] == ["srun", "--het-group=3"] and "--kill-on-bad-exit=1" not in srun
        assert {f"--nodelist={address.split(':')[0]}", "--nodes=1", "--ntasks=1", "--exact", "--mem=0",
                "--cpus-per-task=6", "--gpus-per-task=1"} <= set(srun)
        assert task[-2:] == ["bash", str(TEACHER_TASK)]
        # the step's own command, run as Slurm would run it (SLURM_LOCALID 0): it serves on the listed port
        *argv, _ = _run_teacher_task(tmp_path, task, {"SLURM_LOCALID": "0"})
        port = load_config(None, build_parser().parse_args(argv).overrides).addresses.teacher.rsplit(":", 1)[1]
        assert port == address.rsplit(":", 1)[1]
    plan, run_dir = _dry_run(tmp_path / "none", env={"FLYWHEEL_CONFIG": str(tmp_path / "tiny.yaml")})
    assert not any(name.startswith("teacher") for name in plan)
    assert load_config(run_dir / "config.yaml").teacher.addresses == []
    assert _flywheel_args(plan["controller"]).service == "controller"


def _run_teacher_task(tmp_path: Path, command: list[str], env: dict[str, str]) -> list[str]:
    """The argv `flywheel` gets from teacher_task.sh run by `command`, and the CUDA_VISIBLE_DEVICES it starts with,
    last."""
    fake = tmp_path / "flywheel"
    fake.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                    "print(json.dumps(sys.argv[1:] + [os.environ.get('CUDA_VISIBLE_DEVICES')]))\n")
    fake.chmod(0o755)
    full = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "FLYWHEEL_TEACHER_INDEX")}
    full |= {"FLYWHEEL_BIN": str(fake), "FLYWHEEL_RESOLVED_CONFIG": "/shared/run/config.yaml",
             "FLYWHEEL_TEACHER_PORT_BASE": "6000", **env}
    run = subprocess.run(command, env=full, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("index, visible, expected", [
    (1, "0,1,2,3", "1"),  # the step sees the node's GPUs: replica 1 takes its own
    (1, "5", "5"),        # Slurm bound the step's GPU itself: kept
    (0, None, None),      # a CPU job: nothing set, nothing added
])
def test_a_teacher_replica_listens_on_its_port_on_its_own_gpu(tmp_path, index, visible, expected):
    # SLURM_LOCALID is 0 in a one-task step: the port and GPU come from the index launch.sh passes
    env = {"SLURM_LOCALID": "0", "FLYWHEEL_TEACHER_INDEX": str(index)}
    *argv, devices = _run_teacher_task(tmp_path, ["bash", str(TEACHER_TASK)],
                                       env | ({"CUDA_VISIBLE_DEVICES": visible} if visible else {}))
    args = build_parser().parse_args(argv)
    assert (args.service, args.config) == ("teacher", "/shared/run/config.yaml")
    assert load_config(None, args.overrides).addresses.teacher == f"0.0.0.0:{6000 + index}"
    assert devices == expected


def test_a_teacher_task_without_its_index_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if k != "FLYWHEEL_TEACHER_INDEX"}
    run = subprocess.run(["bash", str(TEACHER_TASK)], env=env | {"FLYWHEEL_RESOLVED_CONFIG": "/x.yaml"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode != 0 and "FLYWHEEL_TEACHER_INDEX" in run.stderr

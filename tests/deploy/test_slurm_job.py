"""The Slurm deployment, run for real: make_sbatch.py writes the heterogeneous job, sbatch submits it to
a throwaway cluster of five logical nodes, and the tiny CPU run trains end to end across its components:
infra on n1, two gloo trainer ranks (srun tasks) on n2, one rollout worker on n3. Mid-run the replay
service is killed with SIGKILL; launch.sh starts it again and the job still completes every step. The run also
scores an environment with a reward model, so the job has a fourth component, its server on n4; and it is an
on-policy distillation run whose tiny teacher is the fifth: two `flywheel serve teacher` replicas on n5, each an srun
step of its own. Replica 0 is killed with replay, and launch.sh restarts it alone: replica 1 keeps its process.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from processes import processes_mentioning
from services.common.config import load_config
from services.common.infra import free_port
from services.common.jsonl import read_rows

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
STEPS = 10
KILL_AFTER = 1  # steps done when replay and teacher replica 0 are killed
K = 3  # the teacher's top-k
"""The tiny steps take tens of milliseconds: the steps after KILL_AFTER must outlast the killer's reaction, or
it kills a replay the run no longer needs and the restarted one is never waited for."""
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _job_states(env: dict, job_id: str) -> list[dict[str, str]]:
    """One dict per het component (scontrol's key=value fields), component 0 first."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                         check=True).stdout
    rows = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines() if line.strip()]
    return sorted(rows, key=lambda r: int(r.get("HetJobOffset", 0)))


def _wait_for_job(env: dict, job_id: str, timeout_s: float) -> list[str]:
    """Each component's final JobState, polled every second. Not `sbatch --wait`: it sleeps longer and longer between
    its polls, and a job that ended just after one of them (about 43 s in) kept the test waiting ~30 s more."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [c["JobState"] for c in _job_states(env, job_id)]
        if all(state in FINAL for state in states) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def _teacher_pids(run_dir: Path) -> dict[str, int]:
    """Port -> pid of each `flywheel serve teacher` process of the run (the srun task's process, not srun)."""
    pids = {}
    for line in processes_mentioning(str(run_dir)):
        found = re.search(r"serve teacher .*addresses\.teacher=0\.0\.0\.0:(\d+)", line)
        if found and "srun" not in line:
            pids[found[1]] = int(line.split(":")[0])
    return pids


def _kill_after(run_dir: Path, steps: int, killed: list[str], teachers: dict, deadline_s: float = 600) -> None:
    """Once `steps` steps are done, SIGKILL the replay service and teacher replica 0's server (the srun tasks'
    processes, not srun); then note every teacher server's pid once replica 0 runs again, in teachers["after"]. Replay
    goes too so that the run waits for the launcher: it cannot end before the launcher has seen replica 0 die."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + deadline_s
    while len(read_rows(metrics)) < steps:
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    first = load_config(run_dir / "config.yaml").teacher.addresses[0].rsplit(":", 1)[1]
    teachers["before"] = _teacher_pids(run_dir)
    for line in processes_mentioning(str(run_dir)):
        if "serve replay" in line and "srun" not in line:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
            killed.append(line)
    os.kill(teachers["before"][first], signal.SIGKILL)
    while time.monotonic() < deadline:
        now = _teacher_pids(run_dir)
        if now.get(first, teachers["before"][first]) != teachers["before"][first]:
            teachers["after"] = now
            return
        time.sleep(0.05)


def _run_job(slurm_cluster: dict, tmp_path: Path, config: dict, *make_args: str, during=None):
    """make_sbatch.py --cpu for `config`, then sbatch and wait for the job; `during(run_dir)` runs in a thread
    meanwhile. Returns the job's id, the job's output, the components' log tails and the run dir; fails with all of
    them if the job did not succeed."""
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump(config))
    job = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, str(ROOT / "deploy/slurm/make_sbatch.py"), str(base), "--cpu",
                    "--trainer-nodes", "1", "--rollout-nodes", "1", "--rollout-gpus", "1",
                    "--infra-cpus", "1", "--infra-mem", "1000", "--trainer-mem", "1000", "--rollout-mem", "1000",
                    "--time", "00:14:00", "--home", str(ROOT), "--venv", str(VENV),
                    "--output-log", str(tmp_path / "slurm-%j.out"), "-o", str(job), *make_args], check=True)
    run_dir = tmp_path / "run"
    ports = {f"FLYWHEEL_{k}_PORT": str(free_port()) for k in
             ("NATS", "NATS_MONITOR", "REDIS", "CONTROLLER", "ENVIRONMENT", "REPLAY", "TRAINER", "MASTER",
              "REWARD_MODEL", "TEACHER")}
    env = {**slurm_cluster, **ports, "FLYWHEEL_RUN_DIR": str(run_dir), "FLYWHEEL_METRICS_PORT_BASE": "0",
           "FLYWHEEL_ROLLOUT_PORT_BASE": str(free_port()),
           "FLYWHEEL_TEACHER_PORT_BASE": ports.pop("FLYWHEEL_TEACHER_PORT"), "FLYWHEEL_START_TIMEOUT_S": "240",
           "FLYWHEEL_STOP_GRACE_S": "10", "OMP_NUM_THREADS": "1"}
    watcher = threading.Thread(target=during, args=(run_dir,), daemon=True) if during else None
    if watcher:
        watcher.start()
    submit = subprocess.run(["sbatch", "--parsable", str(job)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]
    states = _wait_for_job(env, job_id, timeout_s=840)
    if watcher:
        watcher.join(timeout=1)
    out = "\n".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert states == ["COMPLETED"] * len(states), f"{states}\n{out}\n{logs}"
    return job_id, out, logs, run_dir


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_heterogeneous_job_trains_the_tiny_model_across_its_components(slurm_cluster, tmp_path):
    """One job for every component (each further job costs the suite about a minute): an on-policy distillation run
    whose teacher servers the job starts, on the toy task beside an environment scored by the reward model."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"copy {i}"}]}) + "\n"
                            for i in range(8)))
    killed: list[str] = []
    teacher_pids: dict[str, dict[str, int]] = {}
    job_id, out, logs, run_dir = _run_job(slurm_cluster, tmp_path, {
        "run": {"name": "slurm-tiny"}, "policy": {"model_name": "tiny"},
        "environments": [{"name": "toy", "kind": "toy_copy"},
                         {"name": "rm", "kind": "reward_model", "dataset": str(rows)}],
        "env": {"reward_model": {"model_name": "tiny", "precision": "float32"}},
        "distillation": {"max_num_steps": STEPS, "num_prompts_per_step": 2, "num_generations_per_prompt": 4,
                         "topk_logits_k": K},
        "teacher": {"model_name": "tiny", "tiny": {"num_hidden_layers": 3}, "num_replicas": 2},
        "grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}}},
        "--trainer-gpus", "2", during=lambda run_dir: _kill_after(run_dir, KILL_AFTER, killed, teacher_pids))

    components = _job_states(slurm_cluster, job_id)
    assert [c["JobState"] for c in components] == ["COMPLETED"] * 5, components
    assert [c["ExitCode"] for c in components] == ["0:0"] * 5
    assert [c["NodeList"] for c in components] == ["n1", "n2", "n3", "n4", "n5"]  # each component on its own node
    assert "trainer exited with 0" in out
    assert len(killed) == 1, killed
    assert re.search(r"flywheel: replay exited with \d+; restarting in 1 s \(1/5\)", out), out
    assert (run_dir / "logs" / "replay.log").read_text().count("replay serving on") == 2
    metrics = read_rows(run_dir / "metrics.jsonl")
    assert len(metrics) == STEPS  # one line per training step
    rng = sorted(p.name for p in (run_dir / "checkpoints" / f"step_{STEPS}" / "rng").iterdir())
    assert rng == ["rank_0.pt", "rank_1.pt"]  # two trainer ranks, started by srun, saved the last checkpoint
    assert re.search(r"Ready to accept connections", (run_dir / "logs" / "redis.log").read_text())
    assert "reward_model serving on" in (run_dir / "logs" / "reward_model.log").read_text(), logs
    assert "failed" not in (run_dir / "logs" / "environment.log").read_text(), logs
    rewards = [r["train/reward_mean/rm"] for r in metrics if "train/reward_mean/rm" in r]
    assert rewards and all(r != 0.0 for r in rewards), rewards  # the model's scores, not failures
    # The teacher ran in the fifth component, where the resolved config sends rollout; the trainer refuses a batch
    # with a completion that lacks the teacher's top-k (batch.py, MissingTeacherScores), so every step it took
    # trained on groups the teacher scored: its loss is the KL to them.
    # Two replicas, each its own srun step: the killed one was restarted alone, and the other kept its process.
    ports = [a.rsplit(":", 1)[1] for a in load_config(run_dir / "config.yaml").teacher.addresses]
    assert len(ports) == 2 and set(teacher_pids.get("before", {})) == set(ports), teacher_pids
    assert "after" in teacher_pids, f"teacher replica 0 never ran again: {teacher_pids}\n{out}\n{logs}"
    before, after = teacher_pids["before"], teacher_pids["after"]
    assert after[ports[0]] != before[ports[0]] and after.get(ports[1]) == before[ports[1]], teacher_pids
    assert re.search(r"flywheel: teacher-0 exited with \d+; restarting in 1 s \(1/5\)", out), out
    assert "teacher-1 exited" not in out, out
    for k, port in enumerate(ports):
        teacher_log = (run_dir / "logs" / f"teacher-{k}.log").read_text()
        assert f"teacher serving on 0.0.0.0:{port}" in teacher_log, teacher_log
        assert f"(top-{K})" in teacher_log
    assert (run_dir / "logs" / "teacher-1.log").read_text().count("teacher serving on") == 1
    assert all(math.isfinite(r["train/loss"]) and r["train/loss"] > 0 for r in metrics), metrics
    assert not processes_mentioning(str(run_dir)), "a component outlived the job"

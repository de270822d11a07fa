#!/usr/bin/env python3
"""Write the sbatch script of a Flywheel heterogeneous job from a run config.

    python deploy/slurm/make_sbatch.py CONFIG [key=value ...] --trainer-nodes 1 --trainer-gpus 8 \\
        --rollout-nodes 2 --rollout-gpus 8 -o job.sbatch
    sbatch job.sbatch

Three components, one per het group (launch.sh starts each with `srun --het-group=K`):
  0  infra    1 node, no GPU: NATS, Redis, controller, environment, replay
  1  trainer  N nodes x G GPUs: one `flywheel serve trainer` task per GPU, ranks from srun
              (SLURM_PROCID/SLURM_NTASKS), MASTER_ADDR = the first trainer node
  2  rollout  M nodes: one `flywheel serve rollout` task per policy.generation.vllm_cfg.tensor_parallel_size
              GPUs (--gpus-per-task=TP, 1 by default)
  3  reward model (only when the config scores with env.reward_model and names no server of its own in
              addresses.reward_model): 1 node, 1 GPU, `flywheel serve reward_model`
  3 or 4  teacher (only in a distillation run whose teacher.addresses names no servers): T nodes, one
              `flywheel serve teacher` task per replica (teacher.num_replicas over T nodes), 1 GPU each, each
              replica an srun step of its own (launch.sh restarts a dead one alone);
              the next group after the reward model's, or 3 without one
With --cpu there are no GPU requests: the trainer runs G gloo ranks per node and rollout R workers per
node, which is how the tests run the tiny model through a real Slurm.

The config (with the overrides) is loaded by Flywheel's own loader first, so a bad key fails here rather
than in the queue; the script records the config's absolute path and the overrides, and launch.sh
resolves them again inside the allocation with the job's addresses and passwords.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.config import ConfigError, FlywheelConfig, ServiceAddresses, load_config  # noqa: E402
from services.common.devices import launched_teachers  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="run config (YAML, Flywheel or NeMo RL form)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, applied after the file")
    p.add_argument("-o", "--output", default="-", help="where to write the script (- = stdout)")
    p.add_argument("--job-name", default="", help="default: run.name")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--time", default="24:00:00", help="time limit (HH:MM:SS)")
    p.add_argument("--home", default="", help="checkout on a shared filesystem (default: the submit directory)")
    p.add_argument("--venv", default="", help="virtualenv of the checkout (default: $FLYWHEEL_HOME/.venv)")
    p.add_argument("--output-log", default="flywheel-%j.out", help="sbatch --output")
    p.add_argument("--cpu", action="store_true", help="no GPU requests (tiny model, gloo, hf engine)")
    p.add_argument("--infra-cpus", type=int, default=16)
    p.add_argument("--infra-mem", default="64G")
    p.add_argument("--trainer-nodes", type=int, default=1, help="N")
    p.add_argument("--trainer-gpus", type=int, default=8, help="G: GPUs (with --cpu, ranks) per trainer node")
    p.add_argument("--trainer-cpus-per-gpu", type=int, default=8)
    p.add_argument("--trainer-mem", default="0", help="per node; 0 = all of it")
    p.add_argument("--rollout-nodes", type=int, default=2, help="M")
    p.add_argument("--rollout-gpus", type=int, default=8, help="GPUs (with --cpu, workers) per rollout node")
    p.add_argument("--rollout-cpus-per-gpu", type=int, default=8)
    p.add_argument("--rollout-mem", default="0", help="per node; 0 = all of it")
    p.add_argument("--teacher-nodes", type=int, default=1,
                   help="T: nodes for the teacher replicas (teacher.num_replicas / T each, 1 GPU per replica)")
    args = p.parse_intermixed_args(argv)
    for name in ("trainer_nodes", "trainer_gpus", "rollout_nodes", "rollout_gpus", "infra_cpus", "teacher_nodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def check_fits(cfg: FlywheelConfig, cpu: bool, rollout_gpus: int, teacher_nodes: int = 1) -> list[str]:
    """Config choices that cannot work on the requested hardware: stop before the queue."""
    problems = []
    if cpu and cfg.weight_sync.backend in ("nccl", "nixl"):
        problems.append(f"weight_sync.backend={cfg.weight_sync.backend} needs GPUs; use gloo or filesystem with --cpu")
    if cpu and cfg.policy.generation.backend == "vllm":
        problems.append("policy.generation.backend=vllm needs GPUs here; use hf with --cpu")
    replicas = launched_teachers(cfg)
    if replicas and replicas % teacher_nodes:
        problems.append(f"teacher.num_replicas {replicas} does not spread evenly over --teacher-nodes {teacher_nodes}")
    tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size  # a rollout worker takes TP GPUs of its node
    if not cpu and rollout_gpus % tp:
        problems.append(f"--rollout-gpus {rollout_gpus} is not a multiple of "
                        f"policy.generation.vllm_cfg.tensor_parallel_size {tp}")
    return problems


def starts_reward_model(cfg: FlywheelConfig) -> bool:
    """The job runs the reward-model server (het group 3): the config scores with one and runs none of its own."""
    return cfg.uses_reward_model and cfg.addresses.reward_model == ServiceAddresses().reward_model


def teacher_cpus(args: argparse.Namespace) -> int:
    """CPUs per teacher replica: launch.sh gives each replica's own srun step (--exact) as many as the group asks."""
    return 1 if args.cpu else args.rollout_cpus_per_gpu


def teacher_group(args: argparse.Namespace, replicas: int) -> list[str]:
    """The teacher's het group: one task per replica, each on a GPU of its own (a replica runs whole in one process)."""
    per_node = replicas // args.teacher_nodes
    gpu = [] if args.cpu else [f"--gpus-per-node={per_node}"]
    return [f"--nodes={args.teacher_nodes}", f"--ntasks-per-node={per_node}", *gpu,
            f"--cpus-per-task={teacher_cpus(args)}", f"--mem={args.rollout_mem}"]


def directives(args: argparse.Namespace, job_name: str, reward_model: bool, teachers: int = 0) -> list[str]:
    head = [f"--job-name={job_name}", f"--time={args.time}", f"--output={args.output_log}",
            "--signal=B:TERM@120"]
    head += [f"--partition={args.partition}"] * bool(args.partition) + [f"--account={args.account}"] * bool(args.account)
    infra = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={args.infra_cpus}", f"--mem={args.infra_mem}"]
    trainer = [f"--nodes={args.trainer_nodes}", f"--ntasks-per-node={args.trainer_gpus}"]
    rollout = [f"--nodes={args.rollout_nodes}", f"--ntasks-per-node={args.rollout_gpus}"]
    if args.cpu:
        trainer += ["--cpus-per-task=1", f"--mem={args.trainer_mem}"]
        rollout += ["--cpus-per-task=1", f"--mem={args.rollout_mem}"]
    else:
        trainer += [f"--gpus-per-node={args.trainer_gpus}", f"--cpus-per-task={args.trainer_cpus_per_gpu}",
                    f"--mem={args.trainer_mem}"]
        rollout += [f"--gpus-per-node={args.rollout_gpus}", f"--cpus-per-task={args.rollout_cpus_per_gpu}",
                    f"--mem={args.rollout_mem}"]
    groups = [("het group 0: infra (NATS, Redis, controller, environment, replay)", infra),
              (f"het group 1: trainer ({args.trainer_nodes} node(s) x {args.trainer_gpus} rank(s))", trainer),
              (f"het group 2: rollout ({args.rollout_nodes} node(s) x {args.rollout_gpus} worker(s))", rollout)]
    if reward_model:
        gpu = ["--cpus-per-task=1"] if args.cpu else ["--gpus-per-node=1", f"--cpus-per-task={args.rollout_cpus_per_gpu}"]
        groups.append(("het group 3: reward model (flywheel serve reward_model)",
                       ["--nodes=1", "--ntasks=1", *gpu, f"--mem={args.rollout_mem}"]))
    if teachers:
        groups.append((f"het group {len(groups)}: teacher ({teachers} x flywheel serve teacher)",
                       teacher_group(args, teachers)))
    lines = [f"#SBATCH {d}" for d in head]
    for title, group in groups:
        if not title.startswith("het group 0"):
            lines.append("#SBATCH hetjob")
        lines.append(f"# ---- {title} ----")
        lines += [f"#SBATCH {d}" for d in group]
    return lines


FABRIC = """\
# NCCL and UCX (docs/deployment.md, "NCCL and UCX"). srun hands these to every task. Set the ones your
# fabric needs; the defaults below are what NCCL and UCX pick on their own.
#   export NCCL_SOCKET_IFNAME=ib0            # interface for NCCL's bootstrap and socket transport
#   export NCCL_IB_HCA=mlx5                  # InfiniBand HCAs (trainer collectives, the nccl weight broadcast)
#   export NCCL_DEBUG=INFO                   # once, when bringing up a new cluster
#   export UCX_TLS=rc,cuda_copy,cuda_ipc     # NIXL's transports (weight_sync.backend: nixl)
#   export UCX_NET_DEVICES=mlx5_0:1
# A dead peer fails a collective (and the sync's timeout applies) instead of hanging it:
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
"""


def _without_output(argv: list[str]) -> list[str]:
    """The command line minus -o/--output, so the script records how to make it, not where it went."""
    out, args = [], iter(argv)
    for a in args:
        if a in ("-o", "--output"):
            next(args, None)
        elif not a.startswith("--output=") and not (a.startswith("-o") and len(a) > 2):
            out.append(a)
    return out


def render(args: argparse.Namespace, cfg: FlywheelConfig, argv: list[str]) -> str:
    config = Path(args.config).resolve()
    home = Path(args.home).resolve() if args.home else None
    shown = f"$FLYWHEEL_HOME/{config.relative_to(ROOT)}" if config.is_relative_to(ROOT) and not home else str(config)
    env = {
        "FLYWHEEL_CONFIG": shown,
        "FLYWHEEL_TRAINER_TASKS_PER_NODE": str(args.trainer_gpus),
        "FLYWHEEL_ROLLOUT_PER_NODE": str(args.rollout_gpus),
        "FLYWHEEL_GPUS": "0" if args.cpu else "1",
    }
    reward_model = starts_reward_model(cfg)
    if reward_model:
        env["FLYWHEEL_REWARD_MODEL_GROUP"] = "3"
    teachers = launched_teachers(cfg)
    if teachers:  # the group after the reward model's
        env["FLYWHEEL_TEACHER_GROUP"] = str(3 + reward_model)
        env["FLYWHEEL_TEACHER_PER_NODE"] = str(teachers // args.teacher_nodes)
        env["FLYWHEEL_TEACHER_CPUS"] = str(teacher_cpus(args))
    if args.venv:
        env["FLYWHEEL_VENV"] = str(Path(args.venv).resolve())
    home_line = (f"FLYWHEEL_HOME=${{FLYWHEEL_HOME:-{shlex.quote(str(home))}}}" if home else
                 "FLYWHEEL_HOME=${FLYWHEEL_HOME:-${SLURM_SUBMIT_DIR:?run this through sbatch or set FLYWHEEL_HOME}}")
    overrides = " ".join(shlex.quote(o) for o in args.overrides)
    return "\n".join([
        "#!/bin/bash",
        f"# Flywheel run {cfg.run.name!r} as a Slurm heterogeneous job. Written by deploy/slurm/make_sbatch.py:",
        f"#   make_sbatch.py {' '.join(shlex.quote(a) for a in _without_output(argv))}",
        "# Submit from the checkout (sbatch passes the environment through; see docs/deployment.md):",
        "#   sbatch THIS_FILE [key=value ...]      # extra overrides go after the recorded ones",
        "# Slurm reads #SBATCH lines only up to the first command; `#SBATCH hetjob` separates the groups.",
        "",
        *directives(args, args.job_name or cfg.run.name, reward_model, teachers),
        "",
        "set -euo pipefail",
        "# sbatch runs a spooled copy of this file: the checkout comes from the environment.",
        home_line,
        "export FLYWHEEL_HOME",
        *(f"export {k}=${{{k}:-{shlex.quote(v) if k != 'FLYWHEEL_CONFIG' else v}}}" for k, v in env.items()),
        *([] if args.cpu else [FABRIC]),
        f'exec bash "$FLYWHEEL_HOME/deploy/slurm/launch.sh" {overrides}{" " if overrides else ""}"$@"',
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"make_sbatch: {err}", file=sys.stderr)
        return 2
    problems = check_fits(cfg, args.cpu, args.rollout_gpus, args.teacher_nodes)
    if problems:
        print("\n".join(f"make_sbatch: {p}" for p in problems), file=sys.stderr)
        return 2
    script = render(args, cfg, argv)
    if args.output == "-":
        sys.stdout.write(script)
    else:
        Path(args.output).write_text(script)
        Path(args.output).chmod(0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main())

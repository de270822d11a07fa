#!/usr/bin/env python3
"""The GPU reservations of docker-compose.yml, from the run config and this host's GPUs, as .env lines.

    python deploy/compose/gpus.py [--config deploy/compose/config.yaml] [key=value ...] >> deploy/compose/.env

docker-compose.yml reserves `TRAINER_GPU` for the trainer, `ROLLOUT_GPU` for rollout, `REWARD_MODEL_GPU` for
the reward-model server and `TEACHER_GPU` for a distillation run's teacher (one replica) (device ids, comma-separated). Docker's `count:` would not do: the engine hands every
container that asks for N GPUs the first N. This prints the ids services/common/devices.py plans (what
`flywheel up` gives the same processes) and refuses what cannot run, with the alternative named. The host's
GPUs come from CUDA_VISIBLE_DEVICES when set (so `CUDA_VISIBLE_DEVICES=0,1 gpus.py` plans for a two-GPU
machine), else from nvidia-smi. `--scale rollout=N` runs N replicas of one service, on the same devices: the
plan places rollout.num_workers workers there and checks that they fit.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.config import ConfigError, format_problems, load_config  # noqa: E402
from services.common.devices import (  # noqa: E402
    Plan,
    Problem,
    capacity_problems,
    demand_of,
    host_gpus,
    placement_problems,
    plan,
)

VARIABLES = {"trainer": "TRAINER_GPU", "rollout-0": "ROLLOUT_GPU", "reward_model": "REWARD_MODEL_GPU",
             "teacher-0": "TEACHER_GPU"}


def compose_plan(cfg, gpus: list[str]) -> tuple[Plan, list[Problem]]:
    """The plan of one rollout service whose replicas (rollout.num_workers of them) share its devices."""
    d = demand_of(cfg)
    if not gpus:
        return Plan(gpus=()), [("<host>", "no GPU here (CUDA_VISIBLE_DEVICES, nvidia-smi): run the CPU file, "
                                "-f deploy/compose/docker-compose.cpu.yml")]
    found = capacity_problems(d, gpus)
    if found:
        return Plan(gpus=tuple(gpus)), found
    # One device set per service (the hf engine's is unused: it samples on CPU, but compose reserves one).
    devices = dict(plan(replace(d, rollout_workers=1, rollout_gpus=max(d.rollout_gpus, 1)), gpus).devices)
    if d.rollout_gpus:  # vLLM replicas (--scale) share the service's devices
        devices |= {f"rollout-{i}": devices["rollout-0"] for i in range(1, d.rollout_workers)}
        checked = devices
    else:
        checked = {n: devs for n, devs in devices.items() if n != "rollout-0"}
    return Plan(gpus=tuple(gpus), devices=devices), placement_problems(d, Plan(gpus=tuple(gpus), devices=checked))


def env_lines(p: Plan) -> list[str]:
    return [f"{var}={','.join(p.devices[name])}" for name, var in VARIABLES.items() if name in p.devices]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "deploy" / "compose" / "config.yaml"))
    parser.add_argument("overrides", nargs="*", help="key=value, as in the service commands' FLYWHEEL_OVERRIDES")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"gpus.py: {err}", file=sys.stderr)
        return 2
    p, found = compose_plan(cfg, host_gpus())
    if found:
        print(format_problems(found), file=sys.stderr)
        return 2
    print(f"# {p.describe()}")
    print("\n".join(env_lines(p)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# One rollout worker per Slurm task of het group 2 (srun gives each task vllm_cfg.tensor_parallel_size GPUs).
# Ports are offset by the task's index on its node, so several workers share a node.
# Overrides precede --config (services/cli.py rejects positionals after options).
# addresses.host='' makes the weight receiver advertise its address on the route towards the trainer.
# rollout.num_workers: this step's task count, so each worker's default share of a step is the right one.
# Devices: launch.sh asks srun for FLYWHEEL_ROLLOUT_TP GPUs per task; task_gpus.sh narrows them where Slurm
# hands every task all of the node's.
set -euo pipefail
: "${FLYWHEEL_RESOLVED_CONFIG:?set by launch.sh}"
source "$(dirname "${BASH_SOURCE[0]}")/task_gpus.sh"
i=${SLURM_LOCALID:-0}
own_gpus "${FLYWHEEL_ROLLOUT_TP:-1}"
m=${FLYWHEEL_METRICS_PORT_BASE:-9400}   # 0: no /metrics server
exec "${FLYWHEEL_BIN:-flywheel}" serve rollout \
  "addresses.rollout=0.0.0.0:$((${FLYWHEEL_ROLLOUT_PORT_BASE:-50054} + i))" \
  "addresses.host=''" \
  "rollout.num_workers=${SLURM_NTASKS:-1}" \
  "telemetry.metrics_port=$(( m == 0 ? 0 : m + 10 + i ))" \
  --config "$FLYWHEEL_RESOLVED_CONFIG"

#!/usr/bin/env bash
# One rollout worker per Slurm task of het group 2 (srun gives each task vllm_cfg.tensor_parallel_size GPUs).
# Ports are offset by the task's index on its node, so several workers share a node.
# Overrides precede --config (services/cli.py rejects positionals after options).
# addresses.host='' makes the weight receiver advertise its address on the route towards the trainer.
# rollout.num_workers: this step's task count, so each worker's default share of a step is the right one.
# Devices: launch.sh asks srun for FLYWHEEL_ROLLOUT_TP GPUs per task. Where Slurm binds them per task, the task
# sees exactly those; where it hands every task the step's GPUs of the node, this task takes its own slice
# (task i: entries i*TP .. i*TP+TP-1), so no two workers' engines start on the same cuda:0.
set -euo pipefail
: "${FLYWHEEL_RESOLVED_CONFIG:?set by launch.sh}"
i=${SLURM_LOCALID:-0}
tp=${FLYWHEEL_ROLLOUT_TP:-1}
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  if (( ${#visible[@]} > tp )); then
    mine=("${visible[@]:i*tp:tp}")
    (( ${#mine[@]} == tp )) || { echo "rollout_task.sh: task $i needs GPUs $((i * tp))..$((i * tp + tp - 1)) of" \
                                      "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >&2; exit 1; }
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${mine[*]}")
    export CUDA_VISIBLE_DEVICES
  fi
fi
m=${FLYWHEEL_METRICS_PORT_BASE:-9400}   # 0: no /metrics server
exec "${FLYWHEEL_BIN:-flywheel}" serve rollout \
  "addresses.rollout=0.0.0.0:$((${FLYWHEEL_ROLLOUT_PORT_BASE:-50054} + i))" \
  "addresses.host=''" \
  "rollout.num_workers=${SLURM_NTASKS:-1}" \
  "telemetry.metrics_port=$(( m == 0 ? 0 : m + 10 + i ))" \
  --config "$FLYWHEEL_RESOLVED_CONFIG"

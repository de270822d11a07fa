#!/usr/bin/env bash
# One teacher replica (`flywheel serve teacher`) per Slurm task of the teacher's het group, on one GPU of its own.
# Task i on its node listens on FLYWHEEL_TEACHER_PORT_BASE + i: launch.sh wrote exactly those host:port pairs into
# the resolved config's teacher.addresses, which rollout calls. Overrides precede --config (services/cli.py).
set -euo pipefail
: "${FLYWHEEL_RESOLVED_CONFIG:?set by launch.sh}"
source "$(dirname "${BASH_SOURCE[0]}")/task_gpus.sh"
i=${SLURM_LOCALID:-0}
own_gpus 1
m=${FLYWHEEL_METRICS_PORT_BASE:-9400}   # 0: no /metrics server
exec "${FLYWHEEL_BIN:-flywheel}" serve teacher \
  "addresses.teacher=0.0.0.0:$((${FLYWHEEL_TEACHER_PORT_BASE:-50057} + i))" \
  "telemetry.metrics_port=$(( m == 0 ? 0 : m + 20 + i ))" \
  --config "$FLYWHEEL_RESOLVED_CONFIG"

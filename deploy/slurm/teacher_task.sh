#!/usr/bin/env bash
# One teacher replica (`flywheel serve teacher`), in an srun step of its own (one task) on a node of the teacher's het
# group: launch.sh starts and restarts each replica alone, so a dead one leaves the others serving. FLYWHEEL_TEACHER_INDEX
# is the replica's index r on its node (SLURM_LOCALID is 0 in every one-task step): it listens on
# FLYWHEEL_TEACHER_PORT_BASE + r, exactly the host:port launch.sh wrote into the resolved config's teacher.addresses,
# which rollout calls, and takes GPU r of the node where Slurm hands the step all of them rather than binding its own.
# Overrides precede --config (services/cli.py).
set -euo pipefail
: "${FLYWHEEL_RESOLVED_CONFIG:?set by launch.sh}"
i=${FLYWHEEL_TEACHER_INDEX:?set by launch.sh: the replica index on its node}
source "$(dirname "${BASH_SOURCE[0]}")/task_gpus.sh"
own_gpus 1 "$i"
m=${FLYWHEEL_METRICS_PORT_BASE:-9400}   # 0: no /metrics server
exec "${FLYWHEEL_BIN:-flywheel}" serve teacher \
  "addresses.teacher=0.0.0.0:$((${FLYWHEEL_TEACHER_PORT_BASE:-50057} + i))" \
  "telemetry.metrics_port=$(( m == 0 ? 0 : m + 20 + i ))" \
  --config "$FLYWHEEL_RESOLVED_CONFIG"

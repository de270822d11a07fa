#!/usr/bin/env bash
# Start Flywheel inside the heterogeneous allocation of an sbatch script from make_sbatch.py
# (flywheel.sbatch is one), wait, and clean up.
#
#   launch.sh [key=value config overrides ...]
#
# It runs on the batch host, which Slurm places on the first node of het group 0 (infra), so NATS's
# monitor port and Redis are checked on loopback. Steps:
#   1. resolve hosts: INFRA_HOST (group 0) and TRAINER_HOST (first node of group 1) from the allocation,
#      as each node's NodeAddr (which is its name unless slurm.conf says otherwise);
#   2. make per-job NATS/Redis passwords, a run token and a controller token, and write nats.conf /
#      redis.conf (mode 600) into the run dir;
#   3. resolve the config (base file + addresses + user overrides) with Flywheel's own loader and write
#      it to $RUN_DIR/config.yaml, which every process reads (the run dir is on a shared filesystem);
#   4. srun --het-group=0: nats-server, redis-server, environment, replay, controller (waiting on health);
#      srun --het-group=1: one `flywheel serve trainer` task per rank (rank = SLURM_PROCID, rendezvous at
#      MASTER_ADDR:MASTER_PORT = the first trainer node);  srun --het-group=2: rollout_task.sh per worker;
#      with FLYWHEEL_REWARD_MODEL_GROUP (make_sbatch.py sets 3 when the config scores with env.reward_model),
#      `flywheel serve reward_model` on that group's node, first (addresses.reward_model points at it);
#      with FLYWHEEL_TEACHER_GROUP (make_sbatch.py sets it in a distillation run that names no teacher servers),
#      one srun step per teacher replica (teacher-0, teacher-1, ...: one task on one node of that group, running
#      teacher_task.sh), before rollout (teacher.addresses lists every replica's host:port);
#   5. wait: success when the trainer exits 0 (last step). A component that exits otherwise (a crash,
#      kill -9, a lost node's step) is started again with the same command, as `flywheel up` does, after
#      a back-off that doubles (1 s .. 16 s); more than run.max_restarts restarts of one component within
#      run.restart_window_s fail the job, and so does exit 78 (the run cannot go on, e.g. dynamic sampling
#      ran out of batches: a restart would fail the same way). On exit (or SIGTERM from --signal before the time limit) stop
#      the services, then Redis and NATS.
#
# FLYWHEEL_DRY_RUN=1 prints the srun commands (also to $RUN_DIR/launch_plan.txt) instead of running
# them, skips the health waits, and takes hosts from FLYWHEEL_INFRA_HOST / FLYWHEEL_TRAINER_HOST /
# FLYWHEEL_INFRA_IP / FLYWHEEL_REWARD_MODEL_HOST / FLYWHEEL_TEACHER_HOSTS when there is no allocation: the unit
# tests use it.
set -euo pipefail

FLYWHEEL_HOME=${FLYWHEEL_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
VENV=${FLYWHEEL_VENV:-$FLYWHEEL_HOME/.venv}
PY=$VENV/bin/python
FLYWHEEL_BIN=$VENV/bin/flywheel
BASE_CONFIG=${FLYWHEEL_CONFIG:-$FLYWHEEL_HOME/deploy/compose/config.yaml}
RUN_DIR=${FLYWHEEL_RUN_DIR:-$FLYWHEEL_HOME/runs/slurm-${SLURM_JOB_ID:-local}}
DRY_RUN=${FLYWHEEL_DRY_RUN:-0}
TRAINER_TASKS=${FLYWHEEL_TRAINER_TASKS_PER_NODE:-1}   # ranks per trainer node (one per GPU)
GPUS=${FLYWHEEL_GPUS:-1}                               # 0: CPU job, no GPU options on srun
REDIS_APPENDFSYNC=${REDIS_APPENDFSYNC:-always}
STOP_GRACE_S=${FLYWHEEL_STOP_GRACE_S:-30}

# Fixed ports on the infra node (and the trainer's first node), overridable (FLYWHEEL_<NAME>_PORT) for
# shared hosts. Metrics ports differ per process because several services share a node:
# base+1 controller, +2 environment, +3 replay, +4 trainer, +10+i rollout worker i (rollout_task.sh).
NATS_PORT=${FLYWHEEL_NATS_PORT:-4222} NATS_MONITOR_PORT=${FLYWHEEL_NATS_MONITOR_PORT:-8222}
REDIS_PORT=${FLYWHEEL_REDIS_PORT:-6379}
CONTROLLER_PORT=${FLYWHEEL_CONTROLLER_PORT:-50051} ENVIRONMENT_PORT=${FLYWHEEL_ENVIRONMENT_PORT:-50052}
REPLAY_PORT=${FLYWHEEL_REPLAY_PORT:-50053} TRAINER_PORT=${FLYWHEEL_TRAINER_PORT:-50055}
MASTER_PORT=${FLYWHEEL_MASTER_PORT:-29400}   # the trainer ranks' c10d rendezvous on the first trainer node
export FLYWHEEL_ROLLOUT_PORT_BASE=${FLYWHEEL_ROLLOUT_PORT_BASE:-50054}
export FLYWHEEL_METRICS_PORT_BASE=${FLYWHEEL_METRICS_PORT_BASE:-9400}
M=$FLYWHEEL_METRICS_PORT_BASE   # 0 turns every /metrics server off
mport() { (( M == 0 )) && echo 0 || echo $(( M + $1 )); }

hosts_of() {  # het group index -> its hostnames, one per line
  local var="SLURM_JOB_NODELIST_HET_GROUP_$1"
  [[ -n "${!var:-}" ]] || { echo "launch.sh: $var is not set: run inside flywheel.sbatch" >&2; return 1; }
  scontrol show hostnames "${!var}"
}

addr_of() {  # Slurm node name -> the address peers dial: its NodeAddr (defaults to the name itself)
  local addr
  addr=$(scontrol show node "$1" -o 2> /dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  echo "${addr:-$1}"
}

ipv4_of() { getent ahostsv4 "$1" | awk 'NR == 1 { print $1 }'; }

INFRA_HOST=${FLYWHEEL_INFRA_HOST:-$(addr_of "$(hosts_of 0 | head -n 1)")}
TRAINER_HOST=${FLYWHEEL_TRAINER_HOST:-$(addr_of "$(hosts_of 1 | head -n 1)")}
TRAINER_NODES=${FLYWHEEL_TRAINER_NODES:-$(hosts_of 1 | wc -l)}
INFRA_IP=${FLYWHEEL_INFRA_IP:-$(ipv4_of "$INFRA_HOST")}
[[ -n "$INFRA_IP" ]] || { echo "launch.sh: cannot resolve $INFRA_HOST" >&2; exit 1; }
# The reward-model server's het group (make_sbatch.py adds group 3 when the config scores with
# env.reward_model and names no server of its own); empty: the job starts none.
RM_GROUP=${FLYWHEEL_REWARD_MODEL_GROUP:-}
RM_OVERRIDES=()
if [[ -n "$RM_GROUP" ]]; then
  RM_HOST=${FLYWHEEL_REWARD_MODEL_HOST:-$(addr_of "$(hosts_of "$RM_GROUP" | head -n 1)")}
  RM_OVERRIDES=("addresses.reward_model=$RM_HOST:${FLYWHEEL_REWARD_MODEL_PORT:-50056}")
fi

# The teacher servers' het group (make_sbatch.py adds it in a distillation run whose teacher.addresses names no
# servers): FLYWHEEL_TEACHER_PER_NODE replicas on each of its nodes, replica r of a node on
# FLYWHEEL_TEACHER_PORT_BASE + r, each with FLYWHEEL_TEACHER_CPUS CPUs (the group's --cpus-per-task).
TEACHER_GROUP=${FLYWHEEL_TEACHER_GROUP:-}
TEACHER_PER_NODE=${FLYWHEEL_TEACHER_PER_NODE:-1}
TEACHER_CPUS=${FLYWHEEL_TEACHER_CPUS:-1}
export FLYWHEEL_TEACHER_PORT_BASE=${FLYWHEEL_TEACHER_PORT_BASE:-50057}
TEACHER_NODES=()   # the group's Slurm node names
TEACHER_OVERRIDES=()
if [[ -n "$TEACHER_GROUP" ]]; then
  TEACHER_HOSTS=${FLYWHEEL_TEACHER_HOSTS:-$(hosts_of "$TEACHER_GROUP")}
  TEACHER_NODES=($TEACHER_HOSTS)   # split on blanks and newlines: node names have neither
  teachers=()
  for node in "${TEACHER_NODES[@]}"; do
    for (( r = 0; r < TEACHER_PER_NODE; r++ )); do
      teachers+=("'$(addr_of "$node"):$(( FLYWHEEL_TEACHER_PORT_BASE + r ))'")
    done
  done
  TEACHER_OVERRIDES=("teacher.addresses=[$(IFS=,; echo "${teachers[*]}")]")
fi

# --- run dir, secrets, infra configs (nothing here is readable by other users) ---
umask 077
mkdir -p "$RUN_DIR/logs" "$RUN_DIR/redis"
NATS_STORE=${FLYWHEEL_NATS_STORE:-$RUN_DIR/nats}   # node-local disk is faster; shared survives requeue
mkdir -p "$NATS_STORE"
secret() { "$PY" -c 'import secrets; print(secrets.token_hex(24))'; }
export NATS_PASSWORD=${NATS_PASSWORD:-$(secret)}
REDIS_PASSWORD=${REDIS_PASSWORD:-$(secret)}
CONTROLLER_TOKEN=${CONTROLLER_TOKEN:-$(secret)}
# Every internal rpc carries it (services/common/security.py); srun hands the environment to each task.
export FLYWHEEL_RUN_TOKEN=${FLYWHEEL_RUN_TOKEN:-$(secret)}
printf '%s\n' "$CONTROLLER_TOKEN" > "$RUN_DIR/controller_token"   # for flywheel env/status --token

cat > "$RUN_DIR/nats.conf" <<EOF
# Written by launch.sh for job ${SLURM_JOB_ID:-local}. Durability: docs/deployment.md.
server_name: flywheel-${SLURM_JOB_ID:-local}
listen: $INFRA_IP:$NATS_PORT
http: 127.0.0.1:$NATS_MONITOR_PORT
max_payload: 8MB
jetstream {
  store_dir: "$NATS_STORE"
  sync_interval: always
}
authorization {
  user: flywheel
  password: \$NATS_PASSWORD
}
EOF

cat > "$RUN_DIR/redis.conf" <<EOF
# Written by launch.sh for job ${SLURM_JOB_ID:-local}. AOF, fsync policy: docs/deployment.md.
bind $( [[ "$INFRA_IP" == 127.0.0.1 ]] && echo 127.0.0.1 || echo "127.0.0.1 $INFRA_IP" )
port $REDIS_PORT
dir $RUN_DIR/redis
appendonly yes
appendfsync $REDIS_APPENDFSYNC
save ""
requirepass $REDIS_PASSWORD
EOF

# --- the resolved config: base file + addresses + user overrides, validated by Flywheel's loader ---
CONFIG=$RUN_DIR/config.yaml
cd "$FLYWHEEL_HOME"
read -r MAX_RESTARTS RESTART_WINDOW_S ROLLOUT_TP < <("$PY" - "$BASE_CONFIG" "$CONFIG" \
  "run.run_dir=$RUN_DIR" \
  "addresses.nats_url=nats://flywheel:$NATS_PASSWORD@$INFRA_HOST:$NATS_PORT" \
  "addresses.redis_url=redis://:$REDIS_PASSWORD@$INFRA_HOST:$REDIS_PORT/0" \
  "addresses.controller=$INFRA_HOST:$CONTROLLER_PORT" \
  "addresses.environment=$INFRA_HOST:$ENVIRONMENT_PORT" \
  "addresses.replay=$INFRA_HOST:$REPLAY_PORT" \
  "addresses.trainer=$TRAINER_HOST:$TRAINER_PORT" \
  "controller.auth_token='$CONTROLLER_TOKEN'" \
  "telemetry.otlp_endpoint='${FLYWHEEL_OTLP_ENDPOINT:-}'" \
  ${RM_OVERRIDES[@]+"${RM_OVERRIDES[@]}"} \
  ${TEACHER_OVERRIDES[@]+"${TEACHER_OVERRIDES[@]}"} \
  "$@" <<'EOF'
import sys
from pathlib import Path
from services.common.config import ConfigError, dump_config, load_config
base, out, *overrides = sys.argv[1:]
try:
    cfg = load_config(base, overrides)
except ConfigError as err:
    sys.exit(f"launch.sh: {err}")
Path(out).write_text(dump_config(cfg))
print(cfg.run.max_restarts, int(cfg.run.restart_window_s), cfg.policy.generation.vllm_cfg.tensor_parallel_size)
EOF
)
[[ -n "${MAX_RESTARTS:-}" ]] || exit 1  # the loader said why
export FLYWHEEL_RESOLVED_CONFIG=$CONFIG FLYWHEEL_BIN
echo "flywheel: job ${SLURM_JOB_ID:-local}  infra $INFRA_HOST ($INFRA_IP)  trainer $TRAINER_HOST  run dir $RUN_DIR"

# --- starting and stopping components ---
# Per-process overrides go BEFORE --config: services/cli.py's argparse rejects positionals after an
# option (`serve X --config F k=v` exits 2), while `serve X k=v --config F` works.
declare -A PIDS=() CMDS=() RESTARTS=()
ORDER=()
start() {  # name, then the command; output goes to $RUN_DIR/logs/<name>.log
  local name=$1; shift
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s:' "$name" | tee -a "$RUN_DIR/launch_plan.txt"
    printf ' %q' "$@" | tee -a "$RUN_DIR/launch_plan.txt"
    echo | tee -a "$RUN_DIR/launch_plan.txt"
    return
  fi
  "$@" >> "$RUN_DIR/logs/$name.log" 2>&1 &
  PIDS[$name]=$!
  [[ -n "${CMDS[$name]:-}" ]] || ORDER+=("$name")
  CMDS[$name]=$(printf '%q ' "$@")
}

restart() {  # name, its exit code: start it again after a back-off, or fail once its budget is spent
  local name=$1 code=$2 now=$SECONDS recent=() t
  for t in ${RESTARTS[$name]:-}; do (( now - t < RESTART_WINDOW_S )) && recent+=("$t"); done
  if (( ${#recent[@]} >= MAX_RESTARTS )); then
    echo "flywheel: $name exited with $code and was restarted $MAX_RESTARTS times within" \
         "$RESTART_WINDOW_S s (run.max_restarts); its log ends:" >&2
    tail -n 30 "$RUN_DIR/logs/$name.log" >&2 || true
    return 1
  fi
  local delay=$(( 1 << ${#recent[@]} )); (( delay > 16 )) && delay=16
  echo "flywheel: $name exited with $code; restarting in $delay s ($(( ${#recent[@]} + 1 ))/$MAX_RESTARTS)" >&2
  RESTARTS[$name]="${recent[*]} $now"
  sleep "$delay"
  eval "start $name ${CMDS[$name]}"
}

stop_group() {  # SIGTERM the named components (srun forwards it to its tasks), wait, then SIGKILL
  local name deadline=$(( SECONDS + STOP_GRACE_S ))
  for name in "$@"; do kill -TERM "${PIDS[$name]}" 2> /dev/null || true; done
  for name in "$@"; do
    while kill -0 "${PIDS[$name]}" 2> /dev/null && (( SECONDS < deadline )); do sleep 1; done
    kill -KILL "${PIDS[$name]}" 2> /dev/null || true
  done
}

stop_all() {  # services first (they drain their NATS connections), then Redis and NATS
  local name services=()
  for name in "${ORDER[@]}"; do [[ "$name" == nats || "$name" == redis ]] || services+=("$name"); done
  (( ${#services[@]} )) && stop_group "${services[@]}"
  for name in redis nats; do [[ -n "${PIDS[$name]:-}" ]] && stop_group "$name"; done
  wait 2> /dev/null || true
}

wait_for() {  # description, then a command that succeeds once the thing is up
  local what=$1; shift
  [[ "$DRY_RUN" == 1 ]] && return 0
  local deadline=$(( SECONDS + ${FLYWHEEL_START_TIMEOUT_S:-300} ))
  until "$@" > /dev/null 2>&1; do
    if (( SECONDS >= deadline )); then echo "launch.sh: $what not up; see $RUN_DIR/logs" >&2; exit 1; fi
    sleep 2
  done
  echo "flywheel: $what up"
}

trap stop_all EXIT
trap 'exit 143' TERM INT

INFRA=(srun --het-group=0 --overlap --nodes=1 --ntasks=1 --unbuffered)

# --- group 0: infra ---
start nats "${INFRA[@]}" "$VENV/bin/nats-server" -c "$RUN_DIR/nats.conf"
start redis "${INFRA[@]}" "${REDIS_SERVER:-redis-server}" "$RUN_DIR/redis.conf"
wait_for nats "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$NATS_MONITOR_PORT/healthz?js-enabled-only=true', timeout=2)"
wait_for redis env REDISCLI_AUTH="$REDIS_PASSWORD" "${REDIS_CLI:-redis-cli}" -h 127.0.0.1 -p "$REDIS_PORT" ping

# --- group 3: the reward-model server, before the environment service, which waits for it to load its model ---
if [[ -n "$RM_GROUP" ]]; then
  RM=(srun --het-group="$RM_GROUP" --nodes=1 --ntasks=1 --unbuffered)
  (( GPUS )) && RM+=(--gpus-per-task=1)
  start reward_model "${RM[@]}" "$FLYWHEEL_BIN" serve reward_model "telemetry.metrics_port=$(mport 5)" --config "$CONFIG"
fi

# --- the teacher's group: its servers load their model while the others start; rollout's groups wait for them ---
# One step per replica, teacher-k, so a dead replica is restarted alone (rollout retries its calls on the others
# meanwhile) and the others keep serving with their model loaded. Replica k runs on node k / PER_NODE as index
# r = k % PER_NODE there, passed as FLYWHEEL_TEACHER_INDEX (SLURM_LOCALID is 0 in every one-task step): its port,
# and its GPU where Slurm hands the step every GPU of the node. --exact: a step takes only its own CPUs (and GPU),
# not the whole node's share of the allocation, which would hold the node's next step until this one ends;
# --mem=0: it may use the job's memory on the node without reserving it, for the same reason.
if [[ -n "$TEACHER_GROUP" ]]; then
  k=0
  for node in "${TEACHER_NODES[@]}"; do
    for (( r = 0; r < TEACHER_PER_NODE; r++, k++ )); do
      TEACHER=(srun --het-group="$TEACHER_GROUP" --nodelist="$node" --nodes=1 --ntasks=1 --exact --mem=0
               --cpus-per-task="$TEACHER_CPUS" --unbuffered)
      (( GPUS )) && TEACHER+=(--gpus-per-task=1)
      start "teacher-$k" "${TEACHER[@]}" env FLYWHEEL_TEACHER_INDEX="$r" \
        bash "$FLYWHEEL_HOME/deploy/slurm/teacher_task.sh"
    done
  done
fi

start environment "${INFRA[@]}" "$FLYWHEEL_BIN" serve environment "telemetry.metrics_port=$(mport 2)" --config "$CONFIG"
start replay "${INFRA[@]}" "$FLYWHEEL_BIN" serve replay "telemetry.metrics_port=$(mport 3)" --config "$CONFIG"
wait_for environment "$PY" deploy/health_probe.py "$INFRA_HOST:$ENVIRONMENT_PORT" flywheel.v1.environment
wait_for replay "$PY" deploy/health_probe.py "$INFRA_HOST:$REPLAY_PORT" flywheel.v1.replay
start controller "${INFRA[@]}" "$FLYWHEEL_BIN" serve controller "telemetry.metrics_port=$(mport 1)" --config "$CONFIG"
wait_for controller "$PY" deploy/health_probe.py "$INFRA_HOST:$CONTROLLER_PORT" flywheel.v1.controller

# --- group 1: trainer, one task per rank (N nodes x G tasks); ranks come from SLURM_PROCID/SLURM_NTASKS ---
# The step gets every GPU of its nodes (no --gpus-per-task), so ranks on a node share NVLink/P2P; each
# rank picks its device by SLURM_LOCALID. Only rank 0 serves gRPC, NATS, /metrics and the weight channel.
export MASTER_ADDR=$TRAINER_HOST MASTER_PORT
[[ "$DRY_RUN" == 1 ]] && printf 'MASTER_ADDR=%s\nMASTER_PORT=%s\n' "$MASTER_ADDR" "$MASTER_PORT" > "$RUN_DIR/launch_env.txt"
# --kill-on-bad-exit: one dead rank ends the step (the others would wait in a collective), and the
# restarted step resumes every rank from the latest checkpoint.
start trainer srun --het-group=1 --nodes="$TRAINER_NODES" --ntasks-per-node="$TRAINER_TASKS" --unbuffered \
  --kill-on-bad-exit=1 \
  "$FLYWHEEL_BIN" serve trainer \
  "addresses.host=$TRAINER_HOST" "telemetry.metrics_port=$(mport 4)" --config "$CONFIG"

# --- group 2: rollout, one worker per task (on a GPU job, vllm_cfg.tensor_parallel_size GPUs each) ---
ROLLOUT=(srun --het-group=2 --unbuffered)
(( GPUS )) && ROLLOUT+=(--gpus-per-task="$ROLLOUT_TP")
export FLYWHEEL_ROLLOUT_TP=$ROLLOUT_TP   # rollout_task.sh takes its slice where Slurm binds no GPUs per task
[[ "$DRY_RUN" == 1 ]] && printf 'FLYWHEEL_ROLLOUT_TP=%s\n' "$FLYWHEEL_ROLLOUT_TP" >> "$RUN_DIR/launch_env.txt"
if [[ -n "${FLYWHEEL_ROLLOUT_PER_NODE:-}" ]]; then  # GPUs (CPU job: workers) per node; a worker takes TP GPUs
  per_node=$FLYWHEEL_ROLLOUT_PER_NODE
  (( GPUS )) && per_node=$(( FLYWHEEL_ROLLOUT_PER_NODE / ROLLOUT_TP ))
  ROLLOUT+=(--ntasks-per-node="$per_node")
fi
start rollout "${ROLLOUT[@]}" bash "$FLYWHEEL_HOME/deploy/slurm/rollout_task.sh"

[[ "$DRY_RUN" == 1 ]] && exit 0

# --- wait: the trainer exiting 0 is success; whatever else exits is restarted (within its budget) ---
while :; do
  for name in "${ORDER[@]}"; do
    kill -0 "${PIDS[$name]}" 2> /dev/null && continue
    wait "${PIDS[$name]}" && code=0 || code=$?
    if [[ "$name" == trainer && "$code" == 0 ]]; then
      echo "flywheel: trainer exited with 0"
      exit 0
    fi
    if [[ "$code" == 78 ]]; then  # RUN_FAILED_EXIT: the run cannot go on, and a restart would fail the same way
      echo "flywheel: $name stopped the run (exit 78); its log ends:" >&2
      tail -n 5 "$RUN_DIR/logs/$name.log" >&2 || true
      exit 1
    fi
    restart "$name" "$code" || exit 1
  done
  sleep 2
done

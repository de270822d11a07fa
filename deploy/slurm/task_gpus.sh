# Sourced by rollout_task.sh and teacher_task.sh. Where Slurm binds GPUs per task, a task sees exactly its own;
# where it hands every task the step's GPUs of the node, task i takes entries i*N .. i*N+N-1, so no two servers'
# models start on the same cuda:0. i is SLURM_LOCALID (the task's index in a multi-task step) unless the caller
# passes it: a teacher replica runs in a one-task step of its own, where SLURM_LOCALID is always 0.
own_gpus() {  # N: the GPUs one task takes; I (optional): the task's index on its node
  local n=$1 i=${2:-${SLURM_LOCALID:-0}} visible mine
  [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]] || return 0   # a CPU job: nothing set, nothing added
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"
  (( ${#visible[@]} > n )) || return 0                # Slurm bound the task's GPUs itself
  mine=("${visible[@]:i*n:n}")
  (( ${#mine[@]} == n )) || { echo "$(basename "$0"): task $i needs GPUs $((i * n))..$((i * n + n - 1)) of" \
                                   "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" >&2; exit 1; }
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${mine[*]}")
  export CUDA_VISIBLE_DEVICES
}

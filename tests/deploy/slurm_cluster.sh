#!/usr/bin/env bash
# A throwaway Slurm cluster on this host, for tests: munged, slurmctld and N slurmd as N logical
# nodes (n1..nN, default 3), everything under DIR, nothing in /etc touched.
#
#   slurm_cluster.sh start DIR [N]  # prints `export SLURM_CONF=DIR/slurm.conf`; waits until every node is idle
#   slurm_cluster.sh stop DIR       # stops what `start` started (by the pids it recorded)
#
# Three nodes, because Slurm (22.05, select/cons_tres) never places two components of one
# heterogeneous job on the same node: Flywheel's three-component job on two nodes stays pending
# with Reason=Resources, even with OverSubscribe=FORCE. Two components on two nodes start at once.
#
# Slurm's clients and daemons read SLURM_CONF; munge's socket is named in slurm.conf (AuthInfo),
# so a system munged or slurm, if any, is left alone. Needs Debian's slurm-wlm and munge, and root
# (slurmd runs jobs as their submitter). Ports: FLYWHEEL_SLURM_PORT_BASE (default: free ones).
set -euo pipefail

cmd=${1:?start|stop}
DIR=$(realpath -m "${2:?state directory}")
NODES=${3:-3}

pid_of() { [[ -s "$DIR/$1.pid" ]] && cat "$DIR/$1.pid"; }

stop() {
  local name pid
  for name in $(cd "$DIR" 2> /dev/null && ls slurmd-n*.pid 2> /dev/null | sed 's/\.pid$//') slurmctld munged; do
    pid=$(pid_of "$name" || true)
    [[ -n "$pid" ]] || continue
    kill -TERM "$pid" 2> /dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2> /dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2> /dev/null || true
  done
  rm -f "$DIR"/*.pid
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start() {
  for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" > /dev/null || { echo "slurm_cluster.sh: $tool not found (apt-get install slurm-wlm munge)" >&2; exit 2; }
  done
  mkdir -p "$DIR"/{munge,state,log,spool}
  chmod 700 "$DIR/munge"
  # munge: a private key and socket; it refuses keys or sockets that others can write.
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge/munge.key"
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
  local host ctld i names
  host=$(hostname)
  ctld=$(free_port)
  names=$(seq -s, -f 'n%g' 1 "$NODES")
  cat > "$DIR/slurm.conf" <<CONF
# Written by tests/deploy/slurm_cluster.sh: one host, two logical nodes.
ClusterName=flywheel-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=bf_interval=5
MpiDefault=none
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
InactiveLimit=0
KillWait=10
CONF
  for i in $(seq "$NODES"); do  # CPUs are what Slurm counts (config_overrides), not real cores
    echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=4 RealMemory=4000" >> "$DIR/slurm.conf"
  done
  echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP" >> "$DIR/slurm.conf"
  export SLURM_CONF=$DIR/slurm.conf
  slurmctld -i
  for i in $(seq "$NODES"); do slurmd -N "n$i"; done
  for _ in $(seq 150); do
    if [[ "$(sinfo -h -N -o '%N %t' 2> /dev/null | awk '$2 == "idle"' | wc -l)" == "$NODES" ]]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  echo "slurm_cluster.sh: nodes not idle after 30 s:" >&2
  sinfo -N >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  stop
  exit 1
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start DIR [NODES] | stop DIR" >&2; exit 2 ;;
esac

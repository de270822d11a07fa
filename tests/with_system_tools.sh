#!/usr/bin/env bash
# Run a command (the test suite) with the system tools the tests drive installed and a Docker engine up:
#   - Debian's slurm-wlm and munge, for the heterogeneous Slurm job of tests/deploy/slurm_cluster.sh;
#   - docker.io, docker-compose (1.29) and debootstrap, for tests/deploy/test_compose_up.py;
#   - buf, for the proto lint (tests/unit/common/test_proto_lint.py).
# `make test` runs the suite through this script, so a fresh machine skips nothing. Installing needs root;
# without it, what is missing is named here and its tests skip with that reason (under FLYWHEEL_CI=1 they fail).
set -euo pipefail

as_root() { if (( EUID == 0 )); then "$@"; elif command -v sudo > /dev/null; then sudo -n "$@"; else return 1; fi; }

apt_install() {
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}

need=()
for tool in slurmctld:slurm-wlm munged:munge dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do
  command -v "${tool%%:*}" > /dev/null || need+=("${tool#*:}")
done
if (( ${#need[@]} )); then
  apt_install "${need[@]}" || echo "with_system_tools: could not install ${need[*]} (needs root); their tests skip" >&2
fi

if ! command -v buf > /dev/null; then
  { command -v npm > /dev/null || apt_install npm; } && as_root npm install -g --silent @bufbuild/buf \
    || echo "with_system_tools: could not install buf (needs npm and root); the proto lint skips" >&2
fi

# A CI container has no bridge and no iptables for dockerd: builds then run on the host's network (the test
# sets FLYWHEEL_BUILD_NETWORK=host when the engine has no default bridge), containers on the project's own
# network. The storage driver is dockerd's own choice: overlay2 where the filesystem allows it (measured:
# docs/deployment.md), else vfs.
# An engine started here is shared: two suites on one host (two clones' `make test` at once) use one dockerd,
# each registered under $DOCKERD_SHARE/users, and the last to leave stops it. A lock orders the start, the
# registrations and the stop, so neither suite starts a second engine or stops the other's.
DOCKERD_SHARE=/tmp/flywheel-dockerd
if command -v dockerd > /dev/null && (( EUID == 0 )); then
  mkdir -p "$DOCKERD_SHARE/users"
  exec {dockerd_lock}> "$DOCKERD_SHARE/lock"
  flock "$dockerd_lock"
  touch "$DOCKERD_SHARE/users/$$"
  if ! docker info > /dev/null 2>&1; then
    rm -f "$DOCKERD_SHARE/pid"  # left by a suite that died with the engine
    log=$(mktemp /tmp/flywheel-dockerd.XXXXXX.log)
    setsid dockerd --iptables=false --ip6tables=false --bridge=none > "$log" 2>&1 < /dev/null &
    echo $! > "$DOCKERD_SHARE/pid"
    for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
    docker info --format 'dockerd {{.ServerVersion}}, storage driver {{.Driver}}' || { tail -20 "$log"; exit 1; }
  fi
  flock -u "$dockerd_lock"
  leave_dockerd() {
    flock "$dockerd_lock"
    rm -f "$DOCKERD_SHARE/users/$$"
    for user in "$DOCKERD_SHARE"/users/*; do  # a suite killed before its trap ran leaves its file behind
      [ -e "$user" ] && ! kill -0 "${user##*/}" 2> /dev/null && rm -f "$user"
    done
    if [ -z "$(ls -A "$DOCKERD_SHARE/users")" ] && [ -f "$DOCKERD_SHARE/pid" ]; then
      pid=$(cat "$DOCKERD_SHARE/pid")
      kill "$pid" 2> /dev/null || true
      for _ in $(seq 30); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
      rm -f "$DOCKERD_SHARE/pid"
    fi
    flock -u "$dockerd_lock"
  }
  trap leave_dockerd EXIT
fi

"$@"

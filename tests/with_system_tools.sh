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
# docs/deployment.md), else vfs. An engine started here is stopped when the command ends.
if command -v dockerd > /dev/null && ! docker info > /dev/null 2>&1 && (( EUID == 0 )); then
  log=$(mktemp /tmp/flywheel-dockerd.XXXXXX.log)
  dockerd --iptables=false --ip6tables=false --bridge=none > "$log" 2>&1 &
  dockerd_pid=$!
  trap 'kill "$dockerd_pid" 2> /dev/null; wait "$dockerd_pid" 2> /dev/null || true' EXIT
  for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
  docker info --format 'dockerd {{.ServerVersion}}, storage driver {{.Driver}}' || { tail -20 "$log"; exit 1; }
fi

"$@"

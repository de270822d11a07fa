#!/usr/bin/env bash
# A local Debian base image, for machines where no image registry answers: debootstrap, then docker import.
#
#   deploy/compose/make_base.sh [IMAGE]          # default flywheel/base:bookworm; prints the image name
#   docker compose ... build --build-arg BASE=flywheel/base:bookworm   (FLYWHEEL_BASE_IMAGE in compose)
#
# Debian bookworm, minbase, plus python3 (3.11), python3-venv and ca-certificates: what the Dockerfile's
# `base` stage needs from `python:3.11-slim-bookworm`. The mirror is the first one apt's own sources name,
# and the host's CA bundle is copied in (package downloads may go through a proxy only it trusts).
# The root filesystem is cached as a tarball (FLYWHEEL_BASE_CACHE, default ~/.cache/flywheel), so a
# second run only re-imports it (seconds instead of about a minute).
set -euo pipefail
IMAGE=${1:-flywheel/base:bookworm}
CACHE=${FLYWHEEL_BASE_CACHE:-$HOME/.cache/flywheel}
TARBALL=$CACHE/base-bookworm.tar

if docker image inspect "$IMAGE" > /dev/null 2>&1; then echo "$IMAGE"; exit 0; fi
mkdir -p "$CACHE"
if [[ ! -s "$TARBALL" ]]; then
  command -v debootstrap > /dev/null || { echo "make_base.sh: apt-get install debootstrap" >&2; exit 2; }
  mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Codename: bookworm' 'Component: main' 2> /dev/null | head -n 1)
  [[ -n "$mirror" ]] || { echo "make_base.sh: apt's sources name no bookworm main mirror" >&2; exit 2; }
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >&2
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  chmod 755 "$root"   # mktemp made it 0700: as the image's /, it would lock every non-root user out
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -cf "$TARBALL.tmp" . && mv "$TARBALL.tmp" "$TARBALL"
fi
# An imported filesystem has no image config: give it the PATH a Debian image has (without it, `ENV
# PATH=/opt/venv/bin:$PATH` in the Dockerfile would leave /bin out, and containers could not find `sh`).
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["bash"]' "$TARBALL" "$IMAGE" > /dev/null
echo "$IMAGE"

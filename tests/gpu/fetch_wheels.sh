#!/usr/bin/env bash
# Gather the GPU check's wheels (tests/gpu/requirements.txt) into wheels/gpu (git-ignored), for a machine with
# Python 3.12 on x86-64 Linux and no network. Run here, where the package index is reachable:
#     tests/gpu/fetch_wheels.sh [DIR]
# Then carry DIR with the command (tests/gpu/README.md). Prints the total size: a carry holds at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-wheels/gpu}
PIP=${PIP:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo "python3 -m pip" )}
mkdir -p "$DIR"
# --no-deps: requirements.txt is the whole list, checked against the machine's packages when check.sh installs.
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform linux_x86_64 -d "$DIR" -r tests/gpu/requirements.txt
BYTES=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "$(ls "$DIR"/*.whl | wc -l) wheels in $DIR: $((BYTES / 1048576)) MiB ($BYTES bytes; a carry holds 64 MiB)"
if [ "$BYTES" -gt $((64 << 20)) ]; then
    echo "over 64 MiB: carry it in two runs (tests/gpu/README.md, 'Over 64 MiB')" >&2
    exit 1
fi

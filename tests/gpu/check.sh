#!/usr/bin/env bash
# `make gpu-check`: install the carried wheels (if any) and run the GPU check's stages (tests/gpu/run.py).
#
# With wheels in wheels/gpu (tests/gpu/fetch_wheels.sh, carried to the GPU machine), they go into .venv-gpu, a
# virtual environment that sees the machine's own packages (--system-site-packages: its CUDA torch,
# transformers, ...), installed with no index: nothing is downloaded. Without wheels it runs on $PYTHON as it is
# (default: .venv's python where `make setup` made one, else python3). Arguments go to run.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${GPU_WHEELS:-wheels/gpu}
PY=${PYTHON:-}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    BASE=${PYTHON:-python3}
    [ -x .venv-gpu/bin/python ] || "$BASE" -m venv --system-site-packages .venv-gpu
    # --no-deps off on purpose: pip checks every wheel's requirements against the machine's packages and the
    # carried ones, so a missing one fails here by name rather than as an import error in a stage.
    .venv-gpu/bin/python -m pip install --quiet --no-index --find-links "$WHEELS" -r tests/gpu/requirements.txt
    PY=.venv-gpu/bin/python
elif [ -z "$PY" ]; then
    PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
fi
exec "$PY" tests/gpu/run.py "$@"

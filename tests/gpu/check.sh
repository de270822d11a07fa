#!/usr/bin/env bash
# `make gpu-check`: install the carried wheels (if any) and run the GPU check's stages (tests/gpu/run.py).
#
# With wheels in wheels/gpu (tests/gpu/fetch_wheels.sh, carried to the GPU machine) and no PYTHON given, they go
# into .venv-gpu, a virtual environment that sees the machine's own packages (--system-site-packages: its CUDA
# torch, transformers, ...), installed with no index: nothing is downloaded. With PYTHON=... (or without
# wheels) it runs on that interpreter as it is, installing nothing (default: .venv's python where `make setup`
# made one, else python3). Arguments go to run.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${GPU_WHEELS:-wheels/gpu}
if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif compgen -G "$WHEELS/*.whl" >/dev/null; then
    if [ ! -x .venv-gpu/bin/python ]; then  # a Python without ensurepip still makes one, pip-less
        python3 -m venv --system-site-packages .venv-gpu || python3 -m venv --system-site-packages --without-pip .venv-gpu
        # python3 may be a venv itself (the GPU machine's is /opt/torch/.venv), whose own packages a child venv's
        # --system-site-packages does not show (only its base interpreter's): name them in a .pth file, read
        # after the venv's own site-packages, so the carried wheels still come first.
        python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
            > "$(.venv-gpu/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/machine-site.pth"
    fi
    PIP=(.venv-gpu/bin/python -m pip)
    .venv-gpu/bin/python -m pip --version >/dev/null 2>&1 || PIP=(python3 -m pip --python .venv-gpu/bin/python)
    # Dependencies are resolved (no --no-deps): pip checks every wheel's requirements against the machine's
    # packages and the carried ones, so a missing one fails here, by name, not as an import error in a stage.
    "${PIP[@]}" install --quiet --no-index --find-links "$WHEELS" -r tests/gpu/requirements.txt
    PY=.venv-gpu/bin/python
else
    PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
fi
exec "$PY" tests/gpu/run.py "$@"

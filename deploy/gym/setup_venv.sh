#!/usr/bin/env bash
# Makes .venv-gym: NeMo Gym in its own interpreter and venv. nemo-gym needs Python >= 3.12 and brings Ray,
# hydra and mlflow, none of which Flywheel imports; Flywheel only starts its servers as subprocesses
# (docs/agents.md, "NeMo Gym").
# Idempotent: a stamp names the version installed, so a second run is a no-op.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${GYM_VENV:-.venv-gym}
VERSION=${NEMO_GYM_VERSION:-0.4.0}   # the newest nemo-gym that installs on Python 3.12 (0.5+ needs 3.13)
STAMP="$VENV/.installed-$VERSION"
[ -f "$STAMP" ] && exit 0
find_python() {
    for candidate in "${GYM_PYTHON:-}" python3.12 "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python" \
                     "$HOME/.pyenv/versions/3.12.1/bin/python"; do
        [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
        "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null \
            && { echo "$candidate"; return; }
    done
    echo "no Python >= 3.12 found (set GYM_PYTHON)" >&2; return 1
}
[ -x "$VENV/bin/python" ] || "$(find_python)" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "nemo-gym==$VERSION"
touch "$STAMP"

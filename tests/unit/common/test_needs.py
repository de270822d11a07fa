"""tests/needs.py: a missing need skips a test outside CI and fails it under FLYWHEEL_CI=1 (a set-up gap in CI
must not pass as a skip). Checked on a throwaway test file run by a real pytest in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]

WANTS = {
    "tool": "from needs import require_tools\n\ndef test_it():\n    require_tools('no-such-tool-flywheel')\n",
    "root": "from needs import require\n\ndef test_it():\n    require(False, 'runs its daemons as root')\n",
    "module": "from needs import require_module\nrequire_module('no_such_module_flywheel')\n\ndef test_it():\n    pass\n",
}


def _outcome(tmp_path: Path, source: str, ci: str) -> str:
    (tmp_path / "test_wants.py").write_text(source)
    env = {**os.environ, "FLYWHEEL_CI": ci, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path / "test_wants.py")], env=env, capture_output=True, text=True, timeout=120)
    return run.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("want", sorted(WANTS))
def test_a_missing_need_skips_outside_ci(tmp_path, want):
    assert "1 skipped" in _outcome(tmp_path, WANTS[want], "0")


@pytest.mark.parametrize("want", sorted(WANTS))
def test_a_missing_need_fails_under_ci(tmp_path, want):
    last = _outcome(tmp_path, WANTS[want], "1")
    assert ("1 failed" in last or "1 error" in last) and "skipped" not in last, last

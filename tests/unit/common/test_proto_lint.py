import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(shutil.which("buf") is None, reason="buf not installed (npm install -g @bufbuild/buf)")
def test_proto_passes_buf_lint():
    proc = subprocess.run(["buf", "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

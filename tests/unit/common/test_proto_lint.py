import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_proto_passes_buf_lint(need_tools):
    need_tools("buf")  # npm install -g @bufbuild/buf
    proc = subprocess.run(["buf", "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

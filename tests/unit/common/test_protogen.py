import subprocess
import sys
from pathlib import Path

from services.common.protogen import OUT_DIR


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py*"))}


def test_generated_stubs_match_the_proto(tmp_path):
    # A subprocess: grpc_tools' protoc extension can crash when loaded next to grpc's in one process.
    subprocess.run([sys.executable, "-m", "services.common.protogen", str(tmp_path / "pb")], check=True, timeout=120)
    assert _tree(tmp_path / "pb") == _tree(OUT_DIR), "stubs are stale: run `make proto`"

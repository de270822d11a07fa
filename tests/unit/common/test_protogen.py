from pathlib import Path

from services.common.protogen import OUT_DIR, generate


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*.py*"))}


def test_generated_stubs_match_the_proto(tmp_path):
    generate(tmp_path / "pb")
    assert _tree(tmp_path / "pb") == _tree(OUT_DIR), "stubs are stale: run `make proto`"

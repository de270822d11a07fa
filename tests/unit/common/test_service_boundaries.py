"""DESIGN.md: services never import each other; they share only services/common and the proto. Read from the
source itself (every import statement of every module of a service package), so an import added anywhere fails."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES_DIR = Path(__file__).resolve().parents[3] / "services"
SERVICES = ("controller", "environment", "replay", "rollout", "trainer")


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" and parts[1] in SERVICES else None


def test_no_service_imports_another_service():
    crossings = []
    for service in SERVICES:
        for path in sorted((SERVICES_DIR / service).rglob("*.py")):
            crossings += [f"{path.relative_to(SERVICES_DIR.parent)} imports {name}"
                          for name in sorted(_imported_modules(path))
                          if _service_of(name) not in (None, service)]
    assert not crossings, "\n".join(crossings)

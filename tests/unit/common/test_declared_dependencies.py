"""Each service's install declares what the service imports (issue 36): `pip install .[trainer]` alone must run
the trainer. Read from the source: follow every import each service's entry module can reach through the
repository (inside functions too: engines and endpoints are imported when configured), and every third-party
distribution reached must be declared in pyproject.toml's base dependencies, in that service's extra, or in one
of the extras a user adds by choice (vLLM, Megatron-Core, NIXL, MLflow). An import guarded by `except
ImportError` is a fallback, not a need. Which distribution provides an import comes from the installed packages'
own metadata, not from a table here."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ENTRIES = {  # service -> (the module `flywheel serve` loads, the extras its image installs)
    "controller": ("services.controller.main", ()),
    "replay": ("services.replay.main", ()),
    "environment": ("services.environment.main", ("environment",)),
    "trainer": ("services.trainer.main", ("trainer",)),
    "rollout": ("services.rollout.main", ("rollout",)),
    "teacher": ("services.rollout.teacher", ("rollout",)),
}
CHOSEN = ("gpu", "vllm-cpu", "megatron", "nixl", "mlflow")
"""Extras of optional engines, transports and trackers: a service imports them only when the config asks."""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(extras: tuple[str, ...]) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {_normal(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


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
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def third_party_imports(entry: str) -> set[str]:
    """Top-level names of the non-stdlib, non-repository modules `entry` can import, transitively."""
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
    return outside


@pytest.mark.parametrize("service", sorted(ENTRIES))
def test_every_import_a_service_loads_is_declared_by_its_extra(service):
    entry, extras = ENTRIES[service]
    declared, providers = _declared(extras + CHOSEN), packages_distributions()
    # A package not installed here (an optional one) is taken to be the distribution of its own name.
    provided = {name: providers.get(name, [name]) for name in third_party_imports(entry)}
    undeclared = {name: dists for name, dists in sorted(provided.items())
                  if not declared & {_normal(d) for d in dists}}
    assert not undeclared, f"{entry} imports {undeclared}, which neither the base dependencies nor {extras} declare"


def test_the_walk_reaches_the_libraries_each_service_is_built_on():
    """The check above passes vacuously if the walk finds nothing: it must find what each service is made of."""
    assert {"grpc", "nats", "redis"} <= third_party_imports("services.replay.main")
    assert {"torch", "transformers"} <= third_party_imports("services.trainer.main")
    assert "torch" not in third_party_imports("services.controller.main")

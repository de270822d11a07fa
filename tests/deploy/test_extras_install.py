"""Each service's install, for real (issue 36): a fresh venv gets the repository with one extra and nothing
else, as a service's image or machine would (`pip install '.[trainer]'`), and every module that service can
import is then imported in it. tests/unit/common/test_declared_dependencies.py reads the same imports from the
source and checks them against pyproject.toml; this test asks pip and the interpreter instead, so it also
catches what metadata alone cannot (a declared package whose own dependencies changed, a package missing from
the built wheel, a console script that does not start).

Three venvs, each made with `python -m venv` and filled by this machine's pip with its own configuration (the
wheel directories and indexes pip.conf names):
  light    the base alone: controller and replay import, and torch is not installed (DESIGN.md: controller,
           replay and environment never import torch); then the `environment` extra on top, as the light
           image has it: environment imports, still no torch.
  trainer  torch first (the extra's own pin, as the Makefile does), then the `trainer` extra: trainer.
  rollout  the same with the `rollout` extra: rollout, teacher and the reward-model server.
"What a service can import" is every repository module its entry module reaches (tests/service_imports.py:
inside functions too, and modules named by string, as the agent registry does). A module may fail to import
only for a package of an extra a user adds by choice (vLLM, Megatron-Core, NIXL, MLflow).

pip runs with --no-compile (nothing is byte-compiled that is not imported) into a venv made without its own
pip (the suite's pip installs into it with --python), which saves ensurepip's few seconds per venv. Each
step's duration is printed (pytest -s shows them; docs/deployment.md keeps the measured ones).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from service_imports import CHOSEN, ENTRIES, REPO, declared, normal, walk

VENVS = {"light": (None, "environment"), "trainer": ("trainer",), "rollout": ("rollout",)}
"""venv -> what is installed into it, in order (None: the base alone); after each, the services whose extra
it is (ENTRIES) must import."""
TORCH_FREE = {"controller", "replay", "environment"}
PROBE = """
import importlib, importlib.util, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        failed[name] = error.name
import services
print(json.dumps({"failed": failed, "services": services.__file__,
                  "torch_installed": importlib.util.find_spec("torch") is not None}))
"""
"""Imports each module named on the command line; prints which failed for a missing module, where `services`
came from, and whether torch is installed at all."""


def _extra(name: str) -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]


def _source(tmp_path: Path) -> Path:
    """A copy of what the package is built from: pip builds a local directory in place (build/, *.egg-info),
    which would litter the checkout and race with another worker's build of it."""
    source = tmp_path / "src"
    shutil.copytree(REPO / "services", source / "services", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    return source


def _timed(what: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout must not be importable
    start = time.monotonic()
    run = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    print(f"{what}: {time.monotonic() - start:.1f} s")
    assert run.returncode == 0, f"{what} failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    return run


def _pip_install(python: Path, requirements: list[str], cwd: Path) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    _timed(f"pip install {' '.join(requirements)}", pip + requirements, cwd)


def _optional_imports(extras: tuple[str, ...]) -> set[str]:
    """Top-level import names provided by the extras a user adds by choice and this venv lacks. Which
    distribution provides an import comes from this interpreter's metadata; a package not installed here is
    taken to be the distribution of its own name."""
    optional = declared(CHOSEN) - declared(extras)
    providers = packages_distributions().items()
    return {name for name, dists in providers if optional & {normal(d) for d in dists}} | optional


def _check(python: Path, services: tuple[str, ...], extras: tuple[str, ...], cwd: Path) -> None:
    modules = sorted(set().union(*(walk(ENTRIES[s][0])[0] for s in services)))
    what = f"import {len(modules)} modules of {', '.join(services)}"
    probe = json.loads(_timed(what, [str(python), "-c", PROBE, *modules], cwd).stdout.splitlines()[-1])
    assert Path(probe["services"]).is_relative_to(python.parents[1]), "services came from outside the venv"
    installed, optional = extras or "the base alone", _optional_imports(extras)
    missing = {module: name for module, name in probe["failed"].items() if name.split(".")[0] not in optional}
    chosen = sorted(set(probe["failed"].values()) - set(missing.values()))
    print(f"not installed, of extras users choose: {chosen}")
    assert not missing, f"with {installed}, modules of {services} import what is not installed: {missing}"
    if TORCH_FREE & set(services):
        assert not probe["torch_installed"], f"torch was installed with {installed}"
    _timed("flywheel serve --help", [str(python.parent / "flywheel"), "serve", services[0], "--help"], cwd)


@pytest.fixture
def venv_dir(tmp_path):
    """Removed after the test: a torch venv is 1.3 GB, and pytest keeps the last three runs' tmp_path."""
    yield tmp_path / "venv"
    shutil.rmtree(tmp_path / "venv", ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("venv", sorted(VENVS))
def test_each_service_imports_from_an_install_of_its_extra_alone(venv, venv_dir, tmp_path):
    source = _source(tmp_path)
    _timed("python -m venv", [sys.executable, "-m", "venv", "--without-pip", str(venv_dir)], tmp_path)
    python = venv_dir / "bin" / "python"
    for extra in VENVS[venv]:
        services = tuple(s for s, (_, extras) in ENTRIES.items() if extras == ((extra,) if extra else ()))
        target = f"{source}[{extra}]" if extra else str(source)
        torch = [r for r in (_extra(extra) if extra else []) if normal(r.split("=")[0]) == "torch"]
        if torch:
            _pip_install(python, torch, tmp_path)  # exactly and first, as the Makefile does
        _pip_install(python, [target], tmp_path)
        _check(python, services, (extra,) if extra else (), tmp_path)


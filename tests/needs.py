"""One gate for every test that needs something this machine may lack (a tool, a package, root, a kernel feature).

Outside CI a missing need skips the test with its reason. Under CI (FLYWHEEL_CI=1) it fails: CI installs
everything the suite drives (`make setup`, tests/with_system_tools.sh), so a skip there would hide a set-up gap
as a pass. Skips that belong to a test's own parametrization (the `gpu` marker, deselected by `-m "not gpu"`)
do not come through here.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest


def under_ci() -> bool:
    return os.environ.get("FLYWHEEL_CI") == "1"


def require(condition: bool, reason: str) -> None:
    """Skip (or, under CI, fail) the current test or module unless `condition` holds."""
    if condition:
        return
    if under_ci():
        pytest.fail(f"{reason} (FLYWHEEL_CI=1: CI provides every need, so this is a failure, not a skip)",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str) -> ModuleType:
    """The imported module, or a skip (a failure under CI) naming why it did not import."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        require(False, f"cannot import {name}: {error}")
        raise  # unreachable: require raised


def require_tools(*tools: str) -> None:
    """Every named tool on PATH. `make test` installs them (tests/with_system_tools.sh)."""
    missing = [t for t in tools if not shutil.which(t)]
    require(not missing, f"not installed: {', '.join(missing)} (make test installs them: tests/with_system_tools.sh)")

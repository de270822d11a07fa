"""services.trainer.algorithms stays pure math: no IO, no network, no other service code."""

import ast
import json
import pathlib
import subprocess
import sys

import services.trainer.algorithms as algorithms

PACKAGE = pathlib.Path(algorithms.__file__).parent
ALLOWED_IMPORTS = {"__future__", "collections", "dataclasses", "math", "typing", "torch", "services"}
ALLOWED_SERVICES = ("services.common.config", "services.trainer.algorithms")
CONFIG_MODULES = ("services.common.config", "services.common.nemo_rl", "services.common.devices")
"""What importing the config loads: its schema, loader, NeMo RL key tables and the device rules it checks
(no IO at import)."""
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval"}


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def _modules() -> list:
    """The package's modules; never none (a moved package would make the checks below pass on nothing)."""
    paths = sorted(PACKAGE.glob("*.py"))
    assert "loss.py" in {p.name for p in paths}, f"no algorithm modules under {PACKAGE}"
    return paths


def test_algorithm_modules_import_only_torch_the_stdlib_math_and_the_config():
    for path in _modules():
        for module in imported_modules(ast.parse(path.read_text())):
            assert module.split(".")[0] in ALLOWED_IMPORTS, f"{path.name} imports {module}"
            if module.startswith("services"):
                assert module.startswith(ALLOWED_SERVICES), f"{path.name} imports {module}"


def test_algorithm_modules_call_no_io_builtins():
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in FORBIDDEN_CALLS, f"{path.name} calls {node.func.id}"


def test_fresh_import_loads_no_transport_or_service_modules():
    code = "import json, sys, services.trainer.algorithms; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    for name in loaded:
        root = name.split(".")[0]
        assert root not in {"grpc", "nats", "redis", "aiohttp", "requests", "httpx", "urllib3"}, name
        if root == "services":
            assert name in {"services", "services.common", "services.trainer"} or name.startswith(
                ALLOWED_SERVICES + CONFIG_MODULES
            ), name

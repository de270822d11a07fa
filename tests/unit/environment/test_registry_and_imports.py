"""The registry builds every built-in kind, and the environment modules never import torch."""

import subprocess
import sys
from pathlib import Path

import pytest

from services.environment import base
from services.environment.base import BUILTIN, Environment, UnknownEnvironment, make_environment

REPO = Path(__file__).resolve().parents[3]


def test_every_builtin_kind_is_registered_under_its_name():
    assert set(BUILTIN) == {"math", "math_multi_reward", "code", "sliding_puzzle", "exact_match", "toy_copy",
                            "tool_add"}
    for kind in BUILTIN:
        env = make_environment(kind)
        assert isinstance(env, Environment) and env.kind == kind


def test_unknown_kind_raises_unknown_environment_naming_the_choices():
    with pytest.raises(UnknownEnvironment, match=r"unknown environment kind 'chess'.*math") as info:
        make_environment("chess")
    assert isinstance(info.value, ValueError)


def test_module_has_no_other_lazy_attributes():
    with pytest.raises(AttributeError):
        base.NOT_THERE  # noqa: B018


def test_importing_the_environment_modules_does_not_import_torch():
    modules = ["services.environment", "services.environment.base", "services.environment.envs",
               "services.environment.envs.code", "services.environment.envs.sandbox"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "from services.environment.base import BUILTIN\nBUILTIN['math']()\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'megatron'))\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_an_env_module_can_be_imported_before_the_base_module():
    code = "import services.environment.envs.math as m\nfrom services.environment.base import BUILTIN\n" \
           "assert BUILTIN['math'] is m.MathEnvironment\n"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)

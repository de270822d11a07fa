"""A tokenizer with no chat template under `policy.tokenizer.chat_template: default` is refused when the run
starts, naming the fix, instead of failing every group in rollout (issue: a base model's `flywheel up` that
printed nothing for 10 minutes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.config import load_config
from services.common.config_base import ConfigError
from services.common.modeling import build_tiny_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory):
    """A tokenizer saved the way a base model ships it: no chat template."""
    path = tmp_path_factory.mktemp("base-model")
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(path)
    return path


def _up(run_dir, *overrides):
    return subprocess.run([sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), *overrides],
                          capture_output=True, text=True, timeout=300)


def test_flywheel_up_refuses_a_tokenizer_without_a_chat_template_before_starting_anything(base_tokenizer_dir, tmp_path):
    run = _up(tmp_path / "run", f"policy.model_name={base_tokenizer_dir}")

    assert run.returncode == 2, run.stdout + run.stderr
    assert "has no chat template" in run.stderr and "policy.tokenizer.chat_template=null" in run.stderr
    assert not (tmp_path / "run" / "logs").exists(), "a service started before the refusal"


def test_the_same_tokenizer_passes_config_check_with_the_passthrough_template(base_tokenizer_dir, tmp_path):
    config = tmp_path / "base.yaml"
    config.write_text(f"policy:\n  model_name: {base_tokenizer_dir}\n  tokenizer:\n    chat_template: null\n"
                      "environments: [{name: toy, kind: toy_copy}]\n")
    check = subprocess.run([sys.executable, "-m", "services.cli", "config", "check", str(config)],
                           capture_output=True, text=True, timeout=300)

    assert check.returncode == 0, check.stdout + check.stderr


def test_a_service_loading_the_tokenizer_refuses_it_too(base_tokenizer_dir):
    cfg = load_config(None, [f"policy.model_name={base_tokenizer_dir}"])

    with pytest.raises(ConfigError, match="policy.tokenizer.chat_template=null"):
        load_tokenizer(cfg.policy)
    cfg = load_config(None, [f"policy.model_name={base_tokenizer_dir}", "policy.tokenizer.chat_template=null"])
    assert load_tokenizer(cfg.policy).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"

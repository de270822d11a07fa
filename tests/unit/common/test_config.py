import subprocess
import sys

import pytest

from services.common.config import ConfigError, FlywheelConfig, dump_config, load_config


def test_overrides_apply_typed_values():
    cfg = load_config(None, ["grpo.max_staleness=2", "loss_fn.ratio_clip_c=3", "policy.model_name=/models/x"])
    assert cfg.grpo.max_staleness == 2 and cfg.loss_fn.ratio_clip_c == 3.0
    assert cfg.policy.model_name == "/models/x"


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grpo:\n  num_prompts_per_step: 4\n  max_staleness: 0\n")
    cfg = load_config(path, ["grpo.max_staleness=3"])
    assert cfg.grpo.num_prompts_per_step == 4 and cfg.grpo.max_staleness == 3


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["grpo.max_num_steps=7"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("override, key", [
    ("grpo.no_such_key=1", "grpo.no_such_key"),
    ("grpo.num_prompts_per_step=-1", "grpo.num_prompts_per_step"),
    ("grpo.max_staleness=abc", "grpo.max_staleness"),
    ("loss_fn.reference_policy_kl_type=k9", "loss_fn.reference_policy_kl_type"),
])
def test_bad_config_raises_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert key in message and "\n" not in message


def test_bad_config_on_the_command_line_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "grpo.num_prompts_per_step=-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "grpo.num_prompts_per_step" in lines[0], proc.stderr


def test_config_schema_imports_without_torch():
    code = "import services.common.config, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_defaults_validate():
    FlywheelConfig()

import subprocess
import sys

import pytest
from pydantic import ValidationError

from services.common.config import ConfigError, FlywheelConfig, dump_config, load_config, write_resolved


def test_overrides_apply_typed_values():
    cfg = load_config(None, ["grpo.async_grpo.max_trajectory_age_steps=2", "loss_fn.ratio_clip_c=3",
                             "policy.model_name=/models/x"])
    assert cfg.grpo.max_staleness == 2 and cfg.loss_fn.ratio_clip_c == 3.0
    assert cfg.policy.model_name == "/models/x"


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grpo:\n  num_prompts_per_step: 4\n  async_grpo: {enabled: true}\n"
                    "environments: [{name: toy, kind: toy_copy}]\n")
    cfg = load_config(path, ["grpo.async_grpo.max_trajectory_age_steps=3"])
    assert cfg.grpo.num_prompts_per_step == 4 and cfg.grpo.max_staleness == 3


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["grpo.max_num_steps=7"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize("override, key", [
    ("grpo.no_such_key=1", "grpo.no_such_key"),
    ("grpo.num_prompts_per_step=-1", "grpo.num_prompts_per_step"),
    ("grpo.async_grpo.max_trajectory_age_steps=abc", "grpo.async_grpo.max_trajectory_age_steps"),
    ("grpo.max_staleness=1", "grpo.async_grpo.max_trajectory_age_steps"),
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


def test_the_embedded_default_names_the_toy_task_and_async_k1():
    cfg = load_config()
    assert [e.kind for e in cfg.environments] == ["toy_copy"] and cfg.policy.model_name == "tiny"
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.max_staleness == 1


def test_a_config_with_no_data_and_no_environment_is_refused_not_run_on_the_toy_task(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  model_name: Qwen/Qwen2.5-1.5B\n")
    with pytest.raises(ConfigError, match="nothing to train on"):
        load_config(path)
    with pytest.raises(ValidationError):
        FlywheelConfig()


def test_a_worker_generates_its_share_of_a_step_at_once_unless_told_otherwise():
    cfg = load_config(None, ["grpo.num_prompts_per_step=32"])
    assert cfg.rollout.max_groups_in_flight is None and cfg.groups_in_flight == 32
    assert load_config(None, ["grpo.num_prompts_per_step=32", "rollout.num_workers=3"]).groups_in_flight == 11
    assert load_config(None, ["rollout.max_groups_in_flight=4"]).groups_in_flight == 4


def test_an_environment_deadline_longer_than_rollouts_step_call_is_refused():
    env = "environments=[{name: slow, address: 'h:1', timeout_s: 120}]"
    with pytest.raises(ConfigError, match=r"'slow': timeout_s 120 must be below rollout.step_timeout_s \(100\)"):
        load_config(None, [env, "rollout.step_timeout_s=100"])
    assert load_config(None, [env]).rollout.step_timeout_s == 300


def test_async_disabled_is_synchronous_whatever_the_age():
    cfg = load_config(None, ["grpo.async_grpo.enabled=false", "grpo.async_grpo.max_trajectory_age_steps=4"])
    assert cfg.grpo.max_staleness == 0


def test_every_problem_is_reported_at_once_each_with_its_key():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["grpo.nope=1", "grpo.num_prompts_per_step=0", "loss_fn.ratio_clip_c=${grpo.missing}",
                           "grpo.batch_multiplier=2", "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true"])
    lines = str(err.value).splitlines()
    for key in ("grpo.nope", "grpo.num_prompts_per_step", "loss_fn.ratio_clip_c", "grpo.batch_multiplier",
                "grpo.async_grpo"):
        assert sum(f": {key}:" in line for line in lines) == 1, (key, lines)
    assert len(lines) == 5


def test_override_prefixes_follow_hydra(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grpo: {num_prompts_per_step: 4}\nenvironments: [{name: toy, kind: toy_copy}]\n")
    assert load_config(path, ["++grpo.max_num_steps=9"]).grpo.max_num_steps == 9
    assert load_config(path, ["~grpo.num_prompts_per_step"]).grpo.num_prompts_per_step == 16
    with pytest.raises(ConfigError, match="grpo.num_prompts_per_step: \\+grpo"):
        load_config(path, ["+grpo.num_prompts_per_step=5"])


def test_defaults_chain_interpolation_and_override_marker(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "grpo: {num_prompts_per_step: 4, max_num_steps: '${mul:${grpo.num_prompts_per_step}, 2}'}\n"
        "environments: [{name: toy, kind: toy_copy}]\nloss_fn: {ratio_clip_min: 0.1, ratio_clip_max: 0.3}\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\ngrpo: {num_prompts_per_step: 5}\n"
                                         "loss_fn: {_override_: true, ratio_clip_max: 0.4}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.grpo.max_num_steps == 10  # interpolation sees the child's value
    assert (cfg.loss_fn.ratio_clip_min, cfg.loss_fn.ratio_clip_max) == (0.2, 0.4)  # base section replaced


def test_a_missing_parent_config_names_both_files(tmp_path):
    (tmp_path / "child.yaml").write_text("defaults: nope.yaml\n")
    with pytest.raises(ConfigError, match="child.yaml: defaults: nope.yaml"):
        load_config(tmp_path / "child.yaml")


def test_an_unknown_key_stops_flywheel_up_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--run-dir", str(run_dir), "grpo.val_perod=3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and not run_dir.exists()
    assert proc.stderr.strip() == "config error: grpo.val_perod: unknown key"


def test_the_resolved_config_is_readable_by_its_owner_only(tmp_path):
    cfg = load_config(None, ["controller.auth_token=s3cret"])
    (tmp_path / "config.yaml").write_text("old")
    (tmp_path / "config.yaml").chmod(0o644)  # a world-readable file left from before is tightened too
    path = write_resolved(cfg, tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_config(str(path)).controller.auth_token == "s3cret"


def test_the_tiny_model_refuses_another_tokenizer():
    with pytest.raises(ConfigError, match="character-level tokenizer"):
        load_config(None, ["policy.tokenizer.name=Qwen/Qwen2.5-1.5B"])
    assert load_config(None, ["policy.model_name=/m", "policy.tokenizer.name=/t"]).policy.tokenizer.name == "/t"

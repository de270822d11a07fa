"""NeMo RL's own sft.yaml, dpo.yaml and rm.yaml load with the two edits docs/nemo_rl_mapping.md lists (each needed), the
section present picks the algorithm, its loop keys drive the run, and keys Flywheel cannot honour are refused."""

import re
from pathlib import Path

import pytest

from services.common.config import ConfigError, load, load_config
from services.common.config_offline import loss_keys

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "tests/fixtures/nemo_rl/examples/configs"


def _edits(name: str) -> list[str]:
    """The edits docs/nemo_rl_mapping.md lists for NeMo RL's `name`.yaml."""
    doc = (ROOT / "docs/nemo_rl_mapping.md").read_text()
    section = doc.split("## Edits NeMo RL's sft.yaml, dpo.yaml and rm.yaml need", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"^\d+\. {name}\.yaml: `([^`]+)`", section, flags=re.M)


@pytest.mark.parametrize("name", ["sft", "dpo", "rm"])
def test_nemo_rl_offline_configs_load_with_at_most_two_documented_edits_each_needed(name):
    edits = _edits(name)
    assert 1 <= len(edits) <= 2
    cfg = load_config(CONFIGS / f"{name}.yaml", edits)
    assert cfg.algorithm == name and cfg.environments == []
    for edit in edits:
        key = edit.split("=")[0].lstrip("+")
        with pytest.raises(ConfigError, match=re.escape(key.rsplit(".", 1)[0])):
            load_config(CONFIGS / f"{name}.yaml", [e for e in edits if e != edit])


def test_sft_yaml_loop_keys_drive_the_shared_step_machinery():
    cfg, notes = load(CONFIGS / "sft.yaml", _edits("sft"))
    assert (cfg.sft.max_num_steps, cfg.sft.val_period, cfg.sft.val_batches, cfg.sft.val_global_batch_size) == (60, 10, 8,
                                                                                                              32)
    assert cfg.sft.val_at_start and not cfg.sft.val_at_end
    assert (cfg.grpo.max_num_steps, cfg.grpo.max_num_epochs, cfg.run.seed) == (60, 1, 42)
    assert cfg.grpo.num_prompts_per_step == 32  # policy.train_global_batch_size examples a step
    assert cfg.grpo.val_period == 0  # no rollout validation: the trainer validates by the loss
    assert any("data.add_eos" in key for key, _ in notes)  # accepted keys are reported, not dropped


def test_dpo_yaml_loss_keys_map_onto_dpo_loss_config_with_its_interpolation():
    cfg = load_config(CONFIGS / "dpo.yaml", _edits("dpo") + ["dpo.preference_average_log_probs=true"])
    assert loss_keys(cfg.dpo) == {"reference_policy_kl_penalty": 0.05, "preference_loss_weight": 1.0,
                                  "sft_loss_weight": 0.0, "preference_average_log_probs": True,
                                  "sft_average_log_probs": True}  # ${.preference_average_log_probs}
    assert cfg.grpo.num_generations_per_prompt == 2  # one group is one (chosen, rejected) pair


def test_rm_yaml_loads_with_the_same_two_edits_as_a_bradley_terry_run():
    cfg, notes = load(CONFIGS / "rm.yaml", _edits("rm"))
    assert cfg.algorithm == "rm" and cfg.rm.max_num_steps == -1 and cfg.grpo.num_generations_per_prompt == 2
    assert cfg.grpo.max_num_steps > 10**6  # -1: the epochs alone end the run
    assert any("policy.reward_model_cfg" in key for key, _ in notes)
    with pytest.raises(ConfigError, match="policy.reward_model_cfg"):
        load_config(CONFIGS / "rm.yaml", [*_edits("rm"), "policy.reward_model_cfg.reward_model_type=regression"])


@pytest.mark.parametrize("override, key", [
    ("sft.only_unmask_final=true", "sft.only_unmask_final"),
    ("data.add_eos=false", "data.add_eos"),
    ("data.add_generation_prompt=true", "data.add_generation_prompt"),
    ("++policy.dtensor_cfg.dp_replicate_size=2", "policy.dtensor_cfg.dp_replicate_size"),
    ("~data.train.data_path", "data.train"),
])
def test_an_offline_key_flywheel_cannot_honour_is_refused_with_its_reason(override, key):
    edits = [e for e in _edits("sft") if not (override.startswith("~") and e.startswith("++data.train"))]
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(CONFIGS / "sft.yaml", [*edits, *([] if override.startswith("~") else [override])])


def test_a_run_trains_one_algorithm_and_none_of_them_with_environments():
    base = ["policy.model_name=tiny", "++data.train.data_path=t.jsonl"]
    with pytest.raises(ConfigError, match="a run trains one algorithm"):
        load_config(CONFIGS / "sft.yaml", [*_edits("sft"), "++dpo.max_num_steps=3"])
    with pytest.raises(ConfigError, match="no rollout"):
        load_config(None, [*base, "++sft.max_num_steps=3"])  # the default run names the toy environment
    assert load_config(None, []).algorithm == "grpo"

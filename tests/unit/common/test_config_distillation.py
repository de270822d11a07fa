"""NeMo RL's own distillation_math.yaml loads with the two edits docs/nemo_rl_mapping.md lists (each needed); its
distillation.*, teacher.* and loss_fn.* keys are honoured or refused with a reason, and a distillation run stays
asynchronous with GRPO's staleness bound."""

import re
from pathlib import Path

import pytest

from services.common.config import ConfigError, dump_config, load, load_config

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "tests/fixtures/nemo_rl/examples/configs/distillation_math.yaml"
EDITS = ["policy.generation.colocated.enabled=false", "policy.dtensor_cfg.context_parallel_size=1"]


def _documented_edits() -> list[str]:
    doc = (ROOT / "docs/nemo_rl_mapping.md").read_text()
    section = doc.split("## Edits NeMo RL's distillation_math.yaml needs", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)


def test_distillation_math_loads_with_the_two_documented_edits_and_its_keys_honoured():
    assert _documented_edits() == EDITS
    cfg, notes = load(CONFIG, EDITS)
    g = cfg.grpo
    assert cfg.algorithm == "distillation" and cfg.offline is None
    assert (g.num_prompts_per_step, g.num_generations_per_prompt, g.max_num_steps, g.max_num_epochs) == (128, 1, 1000, 10)
    assert (g.val_period, g.val_at_start, g.val_at_end, g.max_val_samples, cfg.run.seed) == (20, False, False, 512, 42)
    assert (cfg.teacher.model_name, cfg.teacher.precision, cfg.teacher.topk_logits_k) == ("Qwen/Qwen3-4B", "bfloat16", 64)
    assert (cfg.loss_fn.kl_type, cfg.loss_fn.mixed_kl_weight, cfg.loss_fn.zero_outside_topk) == ("mixed", 0.5, False)
    assert cfg.policy.model_name == "Qwen/Qwen3-1.7B-Base" and g.max_staleness == 0
    keys = {key for key, _ in notes}
    assert {"teacher.dtensor_cfg", "teacher.optimizer", "teacher.generation.*", "distillation.val_batch_size",
            "teacher.tokenizer.name"} <= keys
    assert cfg.teacher.generation.temperature == 1.0  # the policy's, copied by the recipe's YAML anchor


@pytest.mark.parametrize("edit", EDITS)
def test_each_edit_is_needed_and_its_key_is_named(edit):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [e for e in EDITS if e != edit])
    lines = str(err.value).splitlines()
    key = edit.split("=")[0]  # NeMo RL's; context_parallel_size is refused under its Flywheel name, in policy
    assert len(lines) == 1 and (f": {key}: " in lines[0] or f"{key.rsplit('.', 1)[1]} > 1" in lines[0]), lines


def test_loss_and_loop_keys_are_taken_and_grpos_staleness_bound_applies():
    cfg = load_config(CONFIG, [*EDITS, "loss_fn.kl_type=reverse", "loss_fn.zero_outside_topk=true",
                               "distillation.topk_logits_k=8", "distillation.num_generations_per_prompt=4",
                               "++grpo.async_grpo={enabled: true, max_trajectory_age_steps: 2}"])
    assert (cfg.loss_fn.kl_type, cfg.loss_fn.zero_outside_topk, cfg.teacher.topk_logits_k) == ("reverse", True, 8)
    assert cfg.grpo.num_generations_per_prompt == 4 and cfg.grpo.max_staleness == 2


def test_the_teachers_temperature_is_taken_from_its_generation_section():
    """NeMo RL's teacher divides its logits by teacher.generation.temperature before its top-k; the trainer does."""
    assert load_config(CONFIG, [*EDITS, "teacher.generation.temperature=0.5"]).teacher.generation.temperature == 0.5
    cfg = load_config(None, ["++distillation={}", "teacher.model_name=tiny", "teacher.generation.temperature=2"])
    assert cfg.teacher.generation.temperature == 2.0
    assert load_config(None, ["environments=[{name: toy, kind: toy_copy}]"]).teacher.generation.temperature == 1.0


@pytest.mark.parametrize("override, key, reason", [
    ("loss_fn.kl_type=sideways", "loss_fn.kl_type", "forward"),
    ("loss_fn.mixed_kl_weight=1.5", "loss_fn.mixed_kl_weight", "less than or equal to 1"),
    ("++loss_fn.ratio_clip_max=0.3", "<root>", "GRPO's clipped policy-gradient keys"),
    ("++grpo.normalize_rewards=false", "<root>", "set the loop under distillation"),
    ("teacher.generation.temperature=0", "teacher.generation.temperature", "greater than 0"),
    ("teacher.megatron_cfg.enabled=true", "teacher.megatron_cfg", "Megatron-Core teachers are not built"),
    ("teacher.max_total_sequence_length=1024", "teacher.max_total_sequence_length", "whole sequences"),
    ("teacher.tokenizer.name=Qwen/Qwen3-8B", "teacher.tokenizer.name", "must be the student's"),
    ("policy.megatron_cfg.enabled=true", "policy.megatron_cfg.enabled", "the distillation step is the FSDP2 backend's"),
    ("teacher.model_name=null", "teacher.model_name", "needs a teacher"),
    ("++sft.max_num_steps=3", "<root>", "a run trains one algorithm"),
])
def test_a_key_flywheel_cannot_honour_in_a_distillation_run_is_refused_with_its_reason(override, key, reason):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, [*EDITS, override])
    assert any(f": {key}: " in line and reason in line for line in str(err.value).splitlines()), str(err.value)


def test_distillation_loss_and_teacher_keys_outside_a_distillation_run_are_refused():
    with pytest.raises(ConfigError, match="on-policy distillation's keys; they need a distillation: section"):
        load_config(None, ["loss_fn.kl_type=forward"])
    with pytest.raises(ConfigError, match=r"teacher \['model_name'\]: only a distillation run has a teacher"):
        load_config(None, ["teacher.model_name=tiny"])


def test_a_resolved_distillation_config_loads_back_the_same(tmp_path):
    cfg = load_config(CONFIG, [*EDITS, "loss_fn.kl_type=forward", "distillation.max_num_steps=7"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg

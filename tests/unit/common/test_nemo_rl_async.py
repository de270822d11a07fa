"""NeMo RL's single-controller `async_rl` onto Flywheel's async GRPO (docs/nemo_rl_mapping.md, "async_rl").

The oracles are NeMo RL's own files: the single-controller recipes say which legacy `grpo.async_grpo` they
reproduce (the streaming2 recipe is the SingleController variant of performance/...-async-1off.yaml, "Matches
grpo.async_grpo.max_trajectory_age_steps=1"; the -sync recipe is the SC variant of a synchronous one), and the
sampler semantics are those of nemo_rl/algorithms/async_utils/staleness_sampler.py at 7ea279a.
"""

from pathlib import Path

import pytest
import yaml

from services.common.config import ConfigError, load, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures/nemo_rl/examples/configs"
SC = CONFIGS / "grpo_math_1B_megatron_single_controller.yaml"
LLM = CONFIGS / "recipes/llm"
EDITS = ["policy.generation.colocated.enabled=false"]


def async_grpo(path: Path, *overrides: str) -> dict:
    return load_config(path, [*EDITS, *overrides]).grpo.async_grpo.model_dump()


def test_the_streaming_recipe_is_the_async_1off_recipe_it_is_the_single_controller_variant_of():
    legacy = yaml.safe_load((LLM / "performance/grpo-llama3.1-8b-instruct-2n8g-async-1off.yaml").read_text())
    cfg = load_config(LLM / "grpo-llama3.1-8b-instruct-2n8g-async-1off-single-controller-streaming2.yaml", EDITS)
    mapped = cfg.grpo.async_grpo.model_dump()
    assert {key: mapped[key] for key in legacy["grpo"]["async_grpo"]} == legacy["grpo"]["async_grpo"]
    assert (cfg.replay.capacity_groups, cfg.replay.selection) == (128, "fifo")  # max_buffered_rollouts: 128


def test_the_sync_recipe_is_synchronous_grpo():
    for name in ("1n8g", "1n4g"):
        cfg = load_config(LLM / f"grpo-qwen2.5-math-1.5b-instruct-{name}-megatron-single-controller-sync.yaml", EDITS)
        assert not cfg.grpo.async_grpo.enabled and cfg.grpo.max_staleness == 0
        assert cfg.replay.capacity_groups == 32


def test_the_1b_single_controller_config_with_its_whole_resiliency_block_loads_and_notes_each_key():
    cfg, notes = load(SC, EDITS)
    assert cfg.grpo.max_staleness == 1 and cfg.grpo.async_grpo.in_flight_weight_updates
    assert cfg.replay.capacity_groups == 64
    noted = {key for key, _ in notes}
    assert {"async_rl.sampler", "async_rl.min_groups_for_streaming_train", "async_rl.max_inflight_prompts",
            "async_rl.diagnostics", "async_rl.rollout_failure.max_skipped_prompts",
            "async_rl.rollout_failure.min_step_batch_fraction", "async_rl.rollout_failure.native.env_timeout_s",
            "async_rl.stall_watchdog.stall_action", "async_rl.generation_fleet_health",
            "async_rl.generation_router"} <= noted


@pytest.mark.parametrize("overrides, expected", [
    (["async_rl.sampler={name: windowed, max_staleness_versions: 3}"],
     {"enabled": True, "max_trajectory_age_steps": 3, "in_flight_weight_updates": True}),
    (["async_rl.sampler={name: windowed, max_staleness_versions: 0}"], {"enabled": False}),
    (["async_rl.sampler.max_lookahead_versions=0"], {"enabled": False}),
    (["async_rl.sampler.max_lookahead_versions=2"], {"enabled": True, "max_trajectory_age_steps": 2}),
    (["~async_rl.sampler"], {"enabled": True, "max_trajectory_age_steps": 1}),  # NeMo RL's default: in_order, 1
    (["async_rl.recompute_kv_cache_after_weight_updates=true"],
     {"enabled": True, "in_flight_weight_updates": True, "recompute_kv_cache_after_weight_updates": True}),
])
def test_each_sampler_lands_on_grpo_async_grpo(overrides, expected):
    got = async_grpo(SC, *overrides)
    assert {key: got[key] for key in expected} == expected


def test_freshest_first_and_the_buffer_cap_land_on_replay():
    cfg = load_config(SC, [*EDITS, "async_rl.sampler={name: windowed, sample_freshest_first: true}",
                           "async_rl.max_buffered_rollouts=200"])
    assert (cfg.replay.selection, cfg.replay.capacity_groups, cfg.grpo.max_staleness) == ("freshest", 200, 1)


@pytest.mark.parametrize("override, reason", [
    ("async_rl.sampler={name: ready_first}", "trains every ready group however old"),
    ("async_rl.sampler={name: weight_fifo}", "oldest first"),
    ("async_rl.sampler={name: custom, target: 'm:C'}", "user code"),
    ("async_rl.sampler.bogus=1", "not a key of NeMo RL's in_order sampler"),
    ("grpo.async_grpo={enabled: true}", "refuses both"),
    ("async_rl.max_buffered_rollouts=8", "below grpo.num_prompts_per_step"),
    ("async_rl.max_inflight_prompts=7", "set rollout.max_groups_in_flight"),
    ("async_rl.min_groups_for_streaming_train=100000", "refuses more than num_prompts_per_step"),
    ("async_rl.rollout_failure.max_skipped_prompts=1", "the work queue redelivers"),
    ("async_rl.rollout_failure.on_dropped_prompt=replace", "spare prompts"),
    ("async_rl.rollout_failure.native.generation_timeout_s=60", "per-request generation deadlines are not built"),
    ("async_rl.stall_watchdog.stall_action=abort", "ending the run on a stall is not built"),
    ("async_rl.generation_fleet_health.enabled=true", "quarantine are not built"),
    ("async_rl.generation_router.enabled=true", "router"),
    ("++async_rl.no_such_key=1", "unknown key"),
])
def test_what_flywheel_does_not_do_is_refused_with_its_own_reason(override, reason):
    with pytest.raises(ConfigError) as err:
        load_config(SC, [*EDITS, override])
    lines = str(err.value).splitlines()
    assert len(lines) == 1 and reason in lines[0], lines

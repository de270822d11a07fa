"""grpo.reward_scaling (NeMo RL's scale_rewards): clamp to the source range, map it onto the target range; the
trainer's advantages and replay's dynamic-sampling check both see the scaled reward. And the stop-properly
penalty of grpo.reward_shaping, applied after scaling, as NeMo RL does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.common.config import GRPOConfig, RewardScalingConfig
from services.common.pb.flywheel.v1 import types_pb2
from services.common.rewards import scale_reward
from services.replay.validate import zero_variance

DAPO = RewardScalingConfig(enabled=True, target_min=-1.0)  # NeMo RL's DAPO recipes: 0/1 -> -1/1


@pytest.mark.parametrize("reward, expected", [(0.0, -1.0), (1.0, 1.0), (0.25, -0.5), (-3.0, -1.0), (7.0, 1.0)])
def test_dapo_recipe_maps_zero_one_onto_minus_one_one_and_clamps_outside(reward, expected):
    assert scale_reward(reward, DAPO) == pytest.approx(expected)


def test_any_source_and_target_range_follow_nemo_rls_formula():
    cfg = RewardScalingConfig(enabled=True, source_min=-2.0, source_max=6.0, target_min=10.0, target_max=0.0)
    for r in (-5.0, -2.0, 0.0, 3.5, 6.0, 9.0):
        clamped = min(max(r, -2.0), 6.0)
        assert scale_reward(r, cfg) == pytest.approx(10.0 + (clamped + 2.0) / 8.0 * (0.0 - 10.0))


def test_disabled_scaling_leaves_the_reward_alone_and_an_empty_source_range_is_refused():
    assert scale_reward(7.5, RewardScalingConfig(target_min=-1.0)) == 7.5
    with pytest.raises(ValueError, match="source_max"):
        RewardScalingConfig(enabled=True, source_min=1.0, source_max=1.0)


def test_rewards_that_the_clamp_makes_equal_are_a_zero_variance_group():
    group = types_pb2.TrajectoryGroup(completions=[types_pb2.Completion(reward=r) for r in (1.5, 2.0)])
    assert not zero_variance(group)
    assert zero_variance(group, DAPO)


def one_group(rewards, truncated=None):
    from services.trainer.batch import build_batch

    truncated = truncated or [False] * len(rewards)
    completions = [SimpleNamespace(token_ids=[5, 6], generated_mask=[True, True], generation_logprobs=[-1.0, -1.0],
                                   reward=r, version_start=0, truncated=t, named_rewards={}, flaws=[])
                   for r, t in zip(rewards, truncated)]
    return build_batch([SimpleNamespace(prompt_token_ids=[1, 2], completions=completions, prompt_id="p",
                                        env_name="math")], pad_id=0)


def test_the_trainers_advantages_use_the_scaled_reward():
    from services.trainer.batch import batch_advantages

    batch = one_group([1.0, 0.0, 0.0, 1.0])
    plain = GRPOConfig(normalize_rewards=False, use_leave_one_out_baseline=False)
    scaled = GRPOConfig(normalize_rewards=False, use_leave_one_out_baseline=False, reward_scaling=DAPO)
    assert batch_advantages(batch, plain)[0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert batch_advantages(batch, scaled)[0].tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]  # the batch keeps the environments' rewards


def test_stop_properly_penalty_scales_truncated_rewards_after_scaling_and_replaces_the_overlong_penalty():
    from services.common.config import RewardShapingConfig
    from services.trainer.batch import batch_advantages

    batch = one_group([1.0, 1.0, 0.0, 0.0], truncated=[False, True, False, True])
    shaping = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.5, max_response_length=1,
                                  overlong_buffer_length=1)  # the overlong penalty would cut every sample here
    g = GRPOConfig(normalize_rewards=False, use_leave_one_out_baseline=False, reward_scaling=DAPO,
                   reward_shaping=shaping)
    # scaled 1, 1, -1, -1; truncated ones halved: 1, 0.5, -1, -0.5; mean 0
    assert batch_advantages(batch, g)[0].tolist() == pytest.approx([1.0, 0.5, -1.0, -0.5])
    with pytest.raises(ValueError):
        RewardShapingConfig(stop_properly_penalty_coef=1.5)

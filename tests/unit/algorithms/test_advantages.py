"""compute_advantages against a slow float64 loop reference, plus NeMo RL's own expectations."""

import math
import random

import pytest
import torch

from services.trainer.algorithms import compute_advantages


def reference_advantages(rewards, prompt_ids, valid, *, loo, normalize, clip_low=None, clip_high=None):
    """One sample at a time: list the baseline set, take its mean and Bessel std."""
    out = []
    for i, pid in enumerate(prompt_ids):
        group = [j for j, other in enumerate(prompt_ids) if other == pid and valid[j]]
        if not valid[i] or len(group) <= 1:
            out.append(0.0)
            continue
        others = [rewards[j] for j in group if not (loo and j == i)]
        mean = sum(others) / len(others)
        if len(others) <= 1 or len(set(others)) == 1:
            std = 0.0
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in others) / (len(others) - 1))
        advantage = rewards[i] - mean
        if normalize and std > 0:
            advantage /= std + 1e-6
        if clip_low is not None:
            advantage = max(advantage, clip_low)
        if clip_high is not None:
            advantage = min(advantage, clip_high)
        out.append(advantage)
    return out


def random_batch(seed):
    rng = random.Random(seed)
    num_groups = rng.randint(1, 5)
    prompt_ids = [f"p{rng.randrange(num_groups)}" for _ in range(rng.randint(1, 24))]
    binary = rng.random() < 0.5
    rewards = [float(rng.random() < 0.5) if binary else rng.gauss(0, 2) for _ in prompt_ids]
    valid = [rng.random() < 0.85 for _ in prompt_ids]
    return rewards, prompt_ids, valid


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_advantages_match_loop_reference_on_random_groups(seed, loo, normalize):
    rewards, prompt_ids, valid = random_batch(seed)
    clip = (-1.5, 2.0) if seed % 3 == 0 else (None, None)
    fast, _ = compute_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        prompt_ids,
        torch.tensor(valid),
        use_leave_one_out_baseline=loo,
        normalize_rewards=normalize,
        advantage_clip_low=clip[0],
        advantage_clip_high=clip[1],
    )
    slow = reference_advantages(
        rewards, prompt_ids, valid, loo=loo, normalize=normalize, clip_low=clip[0], clip_high=clip[1]
    )
    torch.testing.assert_close(fast, torch.tensor(slow, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_advantages_match_nemo_rl_examples_without_leave_one_out():
    ones = torch.ones(4, dtype=torch.bool)
    kwargs = dict(use_leave_one_out_baseline=False, normalize_rewards=True)
    two_groups, _ = compute_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), list("aabb"), ones, **kwargs)
    torch.testing.assert_close(two_groups, torch.tensor([0.0, 0.0, -(0.5**0.5), 0.5**0.5]), atol=1e-5, rtol=0)
    close, _ = compute_advantages(torch.tensor([1.0, 1.01]), list("aa"), ones[:2], **kwargs)
    torch.testing.assert_close(close, torch.tensor([-(0.5**0.5), 0.5**0.5]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 5.0, -3.7])
@pytest.mark.parametrize("loo", [False, True])
def test_all_equal_rewards_give_exactly_zero_advantage(value, loo):
    rewards = torch.full((6,), value)
    advantages, metrics = compute_advantages(
        rewards, ["a"] * 6, torch.ones(6, dtype=torch.bool),
        use_leave_one_out_baseline=loo, normalize_rewards=True,
    )
    assert torch.equal(advantages, torch.zeros(6))
    assert metrics["advantages/zero_variance_group_fraction"] == 1.0


def test_leave_one_out_with_constant_others_is_not_divided_by_a_rounding_error():
    # Sample 0's others are all 0.1: their std is exactly 0, so its advantage stays 1 - 0.1.
    rewards = torch.tensor([1.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    advantages, _ = compute_advantages(
        rewards, ["a"] * 4, torch.ones(4, dtype=torch.bool),
        use_leave_one_out_baseline=True, normalize_rewards=True,
    )
    assert advantages[0].item() == pytest.approx(0.9, abs=1e-12)


def test_single_sample_groups_and_invalid_samples_get_zero():
    rewards = torch.tensor([3.0, 1.0, 2.0, 7.0, float("nan")])
    valid = torch.tensor([True, True, False, True, False])
    advantages, _ = compute_advantages(
        rewards, ["solo", "pair", "pair", "other", "other"], valid,
        use_leave_one_out_baseline=False, normalize_rewards=True,
    )
    assert torch.equal(advantages, torch.zeros(5))


def test_groups_need_not_be_contiguous():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    interleaved, _ = compute_advantages(
        rewards, list("abab"), torch.ones(4, dtype=torch.bool),
        use_leave_one_out_baseline=True, normalize_rewards=False,
    )
    assert interleaved.tolist() == [1.0, -1.0, -1.0, 1.0]


def test_metrics_summarise_valid_advantages_and_flat_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0])
    valid = torch.tensor([True, True, True, True, False])
    advantages, metrics = compute_advantages(
        rewards, list("aabbc"), valid, use_leave_one_out_baseline=False, normalize_rewards=False
    )
    assert advantages.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]
    assert metrics["advantages/min"] == -0.5 and metrics["advantages/max"] == 0.5
    assert metrics["advantages/mean"] == 0.0
    assert metrics["advantages/zero_variance_group_fraction"] == 0.5

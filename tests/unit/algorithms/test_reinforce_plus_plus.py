"""Reinforce++ advantages against a token-level float64 reference written from NeMo RL's description:
each sample's advantage is spread over its loss tokens and the whitening runs over those tokens."""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from services.common.config import GRPOConfig
from services.trainer.algorithms import reinforce_plus_plus_advantages
from services.trainer.batch import batch_advantages, build_batch


def token_reference(rewards, prompt_ids, loss_tokens, *, minus_baseline):
    """One token at a time: list every loss token's advantage, then whiten that list."""
    shifted = []
    for r, pid in zip(rewards, prompt_ids):
        group = [rewards[j] for j, other in enumerate(prompt_ids) if other == pid]
        shifted.append(r - sum(group) / len(group) if minus_baseline else r)
    tokens = [a for a, n in zip(shifted, loss_tokens) for _ in range(n)]
    if not tokens:
        return [0.0] * len(rewards)
    mean = sum(tokens) / len(tokens)
    var = sum((t - mean) ** 2 for t in tokens) / len(tokens)
    return [(a - mean) / math.sqrt(max(var, 1e-8)) for a in shifted]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("minus_baseline", [True, False])
def test_matches_the_token_level_reference_on_random_batches(seed, minus_baseline):
    rng = random.Random(seed)
    prompt_ids = [f"p{rng.randrange(4)}" for _ in range(rng.randint(2, 20))]
    rewards = [float(rng.random() < 0.5) if seed % 2 else rng.gauss(0, 2) for _ in prompt_ids]
    loss_tokens = [rng.choice([0, 1, 3, 8]) for _ in prompt_ids]
    fast, _ = reinforce_plus_plus_advantages(torch.tensor(rewards, dtype=torch.float64), prompt_ids,
                                             torch.tensor(loss_tokens), minus_baseline=minus_baseline)
    expected = token_reference(rewards, prompt_ids, loss_tokens, minus_baseline=minus_baseline)
    assert fast.tolist() == pytest.approx(expected, abs=1e-9)


def test_a_long_sample_pulls_the_mean_toward_its_advantage():
    """Two samples of one group, rewards 1 and 0, 3 and 1 loss tokens: the token mean of the shifted
    advantages (+0.5 x3, -0.5 x1) is +0.25 and the variance 0.1875, so 0.25/sqrt(0.1875) and -0.75/sqrt(0.1875)."""
    adv, _ = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), ["a", "a"], torch.tensor([3, 1]),
                                            minus_baseline=True)
    assert adv.tolist() == pytest.approx([0.25 / math.sqrt(0.1875), -0.75 / math.sqrt(0.1875)], rel=1e-6)


def test_equal_advantages_give_zero_not_nan_and_no_loss_token_gives_zero():
    flat, _ = reinforce_plus_plus_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), ["a", "a", "b", "b"],
                                             torch.tensor([2, 2, 2, 2]), minus_baseline=True)
    empty, _ = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), ["a", "a"], torch.tensor([0, 0]),
                                              minus_baseline=True)
    assert flat.tolist() == [0.0] * 4 and empty.tolist() == [0.0, 0.0]


def _groups(rewards_by_group, truncated_by_group, length=2):
    return [SimpleNamespace(
        prompt_token_ids=[1, 2], prompt_id=f"p{g}", env_name="math",
        completions=[SimpleNamespace(token_ids=[5] * length, generated_mask=[True] * length,
                                     generation_logprobs=[-1.0] * length, reward=r, version_start=0, truncated=t,
                                     named_rewards={}, flaws=[])
                     for r, t in zip(rewards, truncated)])
        for g, (rewards, truncated) in enumerate(zip(rewards_by_group, truncated_by_group))]


def test_the_step_batch_whitens_over_kept_loss_tokens_and_clips():
    """batch_advantages under adv_estimator reinforce_plus_plus: an overlong-filtered sample keeps its place in
    its group's mean but leaves the whitening (NeMo RL's mask = token_mask * sample_mask); the clip comes last."""
    groups = _groups([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], [[False, False, True], [False, False, False]])
    batch = build_batch(groups, pad_id=0, overlong_filtering=True)
    cfg = GRPOConfig(adv_estimator={"name": "reinforce_plus_plus"}, overlong_filtering=True, advantage_clip_high=1.2)
    adv, metrics = batch_advantages(batch, cfg)
    kept = batch.token_mask.sum(dim=1) * batch.sample_mask
    assert kept.tolist() == [2, 2, 0, 2, 2, 2]
    expected = token_reference(batch.rewards.tolist(), batch.prompt_ids, [int(n) for n in kept.tolist()],
                               minus_baseline=True)
    assert adv.tolist() == pytest.approx([min(a, 1.2) for a in expected], abs=1e-6)
    assert max(expected) > 1.2 and metrics["advantages/max"] == pytest.approx(1.2)


def test_grpo_is_still_the_default_estimator():
    groups = _groups([[1.0, 0.0]], [[False, False]])
    batch = build_batch(groups, pad_id=0)
    adv, _ = batch_advantages(batch, GRPOConfig(use_leave_one_out_baseline=False, normalize_rewards=False))
    assert adv.tolist() == [0.5, -0.5]

"""Overlong filtering masks truncated samples out of the loss only; advantages stay NeMo RL's.

The reference follows NeMo RL's GRPOAdvantageEstimator: every sample of a group is valid for
the baseline and std (valid_mask = ones), whatever `overlong_filtering` says.
"""

import math
import random
from types import SimpleNamespace

import pytest
import torch

from services.common.config import GRPOConfig
from services.trainer.batch import batch_advantages, build_batch


def nemo_rl_advantages(rewards, prompt_ids, *, loo, normalize):
    """calculate_baseline_and_std_per_prompt with valid = ones, one sample at a time, float64."""
    out = []
    for i, pid in enumerate(prompt_ids):
        group = [j for j, other in enumerate(prompt_ids) if other == pid]
        if len(group) <= 1:
            out.append(0.0)  # baseline = reward
            continue
        others = [rewards[j] for j in group if not (loo and j == i)]
        k = len(others)
        baseline = sum(others) / k
        second = sum(x * x for x in others) / k
        std = math.sqrt(max(second - baseline**2, 0.0) * k / (k - 1)) if k > 1 else 0.0
        advantage = rewards[i] - baseline
        if normalize and std > 1e-12:
            advantage /= std + 1e-6
        out.append(advantage)
    return out


def groups_of(rewards_by_group, truncated_by_group):
    groups = []
    for g, (rewards, truncated) in enumerate(zip(rewards_by_group, truncated_by_group)):
        completions = [SimpleNamespace(token_ids=[5, 6], generated_mask=[True, True], generation_logprobs=[-1.0, -1.0],
                                       reward=r, version_start=0, truncated=t, named_rewards={}, flaws=[])
                       for r, t in zip(rewards, truncated)]
        groups.append(SimpleNamespace(prompt_token_ids=[1, 2], completions=completions, prompt_id=f"p{g}",
                                      env_name="math"))
    return groups


def advantages(groups, *, filtering, loo, normalize):
    batch = build_batch(groups, pad_id=0, overlong_filtering=filtering)
    cfg = GRPOConfig(use_leave_one_out_baseline=loo, normalize_rewards=normalize, overlong_filtering=filtering)
    return batch, batch_advantages(batch, cfg)[0]


def test_truncated_sample_keeps_its_groupmates_advantages_as_nemo_rl():
    groups = groups_of([[1.0, 0.0, 0.0]], [[False, False, True]])
    batch, adv = advantages(groups, filtering=True, loo=True, normalize=True)
    assert adv.tolist() == pytest.approx([1.0, -1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    assert batch.sample_mask.tolist() == [1.0, 1.0, 0.0]  # the truncated one leaves the loss only


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("filtering", [False, True])
@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_advantages_match_nemo_rl_with_truncated_samples(seed, filtering, loo, normalize):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
    binary = seed % 2 == 0
    rewards = [[float(rng.random() < 0.5) if binary else rng.gauss(0, 2) for _ in range(n)] for n in sizes]
    truncated = [[rng.random() < 0.4 for _ in range(n)] for n in sizes]
    batch, adv = advantages(groups_of(rewards, truncated), filtering=filtering, loo=loo, normalize=normalize)
    flat = [r for group in rewards for r in group]
    expected = nemo_rl_advantages(flat, batch.prompt_ids, loo=loo, normalize=normalize)
    assert adv.tolist() == pytest.approx(expected, abs=1e-4)
    flat_truncated = [t for group in truncated for t in group]
    assert batch.sample_mask.tolist() == [0.0 if (t and filtering) else 1.0 for t in flat_truncated]
    torch.testing.assert_close(adv, advantages(groups_of(rewards, truncated), filtering=not filtering, loo=loo,
                                               normalize=normalize)[1])


def test_a_sample_with_no_generated_token_leaves_the_loss_and_its_counts():
    """A prompt past data.max_input_seq_length comes with empty completions; NeMo RL gives it loss_multiplier 0."""
    groups = groups_of([[1.0, 0.0]], [[False, False]])
    groups.append(SimpleNamespace(prompt_token_ids=[1, 2, 3, 4], prompt_id="long", env_name="math", completions=[
        SimpleNamespace(token_ids=[], generated_mask=[], generation_logprobs=[], reward=0.0, version_start=0,
                        truncated=True, named_rewards={}, flaws=[]) for _ in range(2)]))
    batch = build_batch(groups, pad_id=0)
    assert batch.sample_mask.tolist() == [1.0, 1.0, 0.0, 0.0]

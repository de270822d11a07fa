"""GDPO advantages against a float64 loop written from NeMo RL's GDPOAdvantageEstimator, and the step batch's
reward components."""

import math
import random
from types import SimpleNamespace

import pytest
import torch
from test_advantages import reference_advantages

from services.common.config import GRPOConfig
from services.trainer.algorithms import gdpo_advantages
from services.trainer.batch import batch_advantages, build_batch


def gdpo_reference(components, prompt_ids, weights, *, loo, normalize):
    """Per component GRPO's advantage (every sample valid), the weighted sum, then (A - mean) / Bessel std."""
    parts = [reference_advantages([row[k] for row in components], prompt_ids, [True] * len(prompt_ids),
                                  loo=loo, normalize=normalize) for k in range(len(weights))]
    total = [sum(w * p[i] for w, p in zip(weights, parts)) for i in range(len(prompt_ids))]
    mean = sum(total) / len(total)
    std = math.sqrt(sum((t - mean) ** 2 for t in total) / (len(total) - 1)) if len(total) > 1 else 0.0
    return [(t - mean) / std if std > 0 else t - mean for t in total]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_matches_the_loop_reference(seed, loo, normalize):
    rng = random.Random(seed)
    prompt_ids = [f"p{rng.randrange(3)}" for _ in range(rng.randint(4, 16))]
    components = [[float(rng.random() < 0.5) for _ in range(3)] for _ in prompt_ids]
    weights = None if seed % 2 else [rng.uniform(0.2, 2.0) for _ in range(3)]
    fast, _ = gdpo_advantages(torch.tensor(components, dtype=torch.float64), prompt_ids, weights=weights,
                              use_leave_one_out_baseline=loo, normalize_rewards=normalize)
    expected = gdpo_reference(components, prompt_ids, weights or [1.0] * 3, loo=loo, normalize=normalize)
    assert fast.tolist() == pytest.approx(expected, abs=1e-9)


def test_weights_must_match_the_components():
    with pytest.raises(ValueError, match="3 reward_weights for 2 reward components"):
        gdpo_advantages(torch.zeros(4, 2), ["a"] * 4, weights=[1.0, 1.0, 1.0], use_leave_one_out_baseline=False,
                        normalize_rewards=True)


def _groups(named_by_group):
    return [SimpleNamespace(
        prompt_token_ids=[1, 2], prompt_id=f"p{g}", env_name="math_multi_reward",
        completions=[SimpleNamespace(token_ids=[5, 6], generated_mask=[True, True], generation_logprobs=[-1.0, -1.0],
                                     reward=sum(n.values()), version_start=0, truncated=False, named_rewards=n,
                                     flaws=[])
                     for n in named])
        for g, named in enumerate(named_by_group)]


def test_the_step_batch_feeds_gdpo_its_components_in_name_order_and_weights_follow_that_order():
    named = [[{"reward/format": 1.0, "reward/correctness": 0.0}, {"reward/format": 0.0, "reward/correctness": 1.0}],
             [{"reward/format": 1.0, "reward/correctness": 1.0}, {"reward/format": 1.0, "reward/correctness": 0.0}]]
    batch = build_batch(_groups(named), pad_id=0)
    assert list(batch.named_rewards) == ["reward/correctness", "reward/format"]
    cfg = GRPOConfig(adv_estimator={"name": "gdpo", "reward_weights": [2.0, 0.5]}, use_leave_one_out_baseline=False)
    adv, _ = batch_advantages(batch, cfg)
    components = [[n["reward/correctness"], n["reward/format"]] for group in named for n in group]
    expected = gdpo_reference(components, batch.prompt_ids, [2.0, 0.5], loo=False, normalize=True)
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert batch.rows(torch.tensor([3, 0])).named_rewards["reward/format"].tolist() == [1.0, 1.0]


def test_gdpo_without_reward_components_says_which_environment_to_use():
    batch = build_batch(_groups([[{}, {}]]), pad_id=0)
    with pytest.raises(ValueError, match="share none .*math_multi_reward"):
        batch_advantages(batch, GRPOConfig(adv_estimator={"name": "gdpo"}))

"""DAPO's overlong penalty against a loop reference."""

import random

import pytest
import torch

from services.common.config import RewardShapingConfig
from services.trainer.algorithms import overlong_reward_penalty


def reference_penalty(length, cfg):
    """NeMo RL's apply_reward_shaping DAPO branch, one response at a time."""
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    exceed = length - expected
    return min(-exceed / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_overlong_penalty_matches_nemo_rl_loop(seed):
    rng = random.Random(seed)
    cfg = RewardShapingConfig(
        enabled=True,
        overlong_buffer_length=rng.randint(1, 64),
        overlong_buffer_penalty=rng.uniform(0, 2),
        max_response_length=rng.randint(64, 256),
    )
    lengths = [rng.randint(0, 300) for _ in range(40)]
    penalty = overlong_reward_penalty(torch.tensor(lengths), cfg)
    expected = torch.tensor([reference_penalty(n, cfg) for n in lengths], dtype=torch.float32)
    torch.testing.assert_close(penalty, expected, rtol=1e-6, atol=1e-6)


def test_overlong_penalty_ramps_from_zero_to_full_at_max_length():
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=100, overlong_buffer_penalty=1.0,
                              max_response_length=500)
    penalty = overlong_reward_penalty(torch.tensor([0, 400, 450, 500]), cfg)
    assert penalty.tolist() == [0.0, 0.0, -0.5, -1.0]


def test_overlong_penalty_is_zero_when_shaping_is_disabled():
    lengths = torch.tensor([10, 10_000])
    assert torch.equal(overlong_reward_penalty(lengths, RewardShapingConfig(enabled=False)), torch.zeros(2))


def test_overlong_penalty_rejects_an_empty_buffer():
    cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=0)
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        overlong_reward_penalty(torch.tensor([1]), cfg)

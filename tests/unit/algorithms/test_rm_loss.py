"""preference_loss (NeMo RL's PreferenceLossFn, the Bradley-Terry reward-model loss) against a slow
pair-by-pair float64 reference: values, metrics and gradients, whole, in micro-batches, over 2 gloo ranks."""

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loss_parity import assert_matches

from services.trainer.algorithms import PreferenceInputs, preference_loss
from services.trainer.algorithms.metrics import combine_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_harness import run_ranks  # noqa: E402

F64 = torch.float64
EPS = 1e-8
PAIRS = 6
MASKS = ["all_valid", "masked_pairs", "float_masks"]
SHAPES = ["[2P]", "[2P, 1]"]


def step_batch(masks: str, seed: int = 0) -> tuple[torch.Tensor, PreferenceInputs]:
    """Scores of 2·PAIRS rows, chosen at even and rejected at odd indices, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    rewards = 2 * torch.randn(2 * PAIRS, generator=g, dtype=F64)
    rewards[3] = rewards[2]  # pair 1 is a tie
    sample_mask = torch.ones(2 * PAIRS, dtype=torch.bool)
    if masks != "all_valid":
        sample_mask[4:6] = False
        sample_mask[10:12] = False
    if masks == "float_masks":
        return rewards, PreferenceInputs(sample_mask=sample_mask.double())
    return rewards, PreferenceInputs(sample_mask=sample_mask)


def reference(rewards, data) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over valid pairs of -log σ(r_chosen - r_rejected), one pair at a time; NeMo RL's metrics."""
    loss, acc, chosen_sum, rejected_sum, pairs = 0.0, 0.0, 0.0, 0.0, 0
    for k in range(rewards.shape[0] // 2):
        if not data.sample_mask[2 * k]:
            continue
        chosen, rejected = rewards[2 * k], rewards[2 * k + 1]
        loss = loss + torch.log(1 + torch.exp(-(chosen - rejected)))
        acc += float(chosen > rejected)
        chosen_sum, rejected_sum = chosen_sum + chosen.item(), rejected_sum + rejected.item()
        pairs += 1
    n = pairs + EPS
    return loss / n, {"loss": (loss / n).item(), "accuracy": acc / n, "rewards_chosen_mean": chosen_sum / n,
                      "rewards_rejected_mean": rejected_sum / n, "num_valid_samples": pairs}


def valid_seqs(data: PreferenceInputs) -> float:
    return float(data.sample_mask.sum())


def rows(data: PreferenceInputs, part: slice) -> PreferenceInputs:
    return PreferenceInputs(sample_mask=data.sample_mask[part])


def accumulate(rewards, data, micro_batches: int, global_valid_seqs: float, shape: str = "[2P]"):
    """(Σ micro-batch losses, gradient w.r.t. the rewards, combined metrics); pairs stay whole."""
    leaf = rewards.detach().clone().requires_grad_(True)
    size = rewards.shape[0] // micro_batches
    total, metrics = 0.0, {}
    for start in range(0, rewards.shape[0], size):
        part = slice(start, start + size)
        scores = leaf[part, None] if shape == "[2P, 1]" else leaf[part]
        loss, m = preference_loss(scores, rows(data, part), global_valid_seqs=global_valid_seqs)
        total, metrics = total + loss, combine_metrics(metrics, m)
    (grad,) = torch.autograd.grad(total, leaf)
    return total, grad, metrics


def expected(rewards, data):
    leaf = rewards.detach().clone().requires_grad_(True)
    loss, metrics = reference(leaf, data)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masks", MASKS)
def test_preference_loss_value_metrics_and_gradient_match_the_pairwise_reference(masks, shape):
    rewards, data = step_batch(masks)
    got = accumulate(rewards, data, 1, valid_seqs(data), shape)
    assert_matches(got, expected(rewards, data))
    assert got[1].abs().max() > 1e-3
    assert 0 < got[2]["accuracy"] < 1  # the tie counts as wrong: [r_chosen > r_rejected] is strict


@pytest.mark.parametrize("micro_batches", [2, 3, 6])
@pytest.mark.parametrize("masks", MASKS)
def test_micro_batch_losses_with_the_step_sequence_count_sum_to_the_whole_batch_loss(masks, micro_batches):
    rewards, data = step_batch(masks)
    got = accumulate(rewards, data, micro_batches, valid_seqs(data))
    assert_matches(got, expected(rewards, data))


def test_preference_loss_refuses_an_odd_number_of_rows():
    rewards, data = step_batch("all_valid")
    with pytest.raises(ValueError, match="pairs"):
        preference_loss(rewards[:5], rows(data, slice(0, 5)), global_valid_seqs=5.0)


def _rank(rank: int, world: int) -> None:
    dist.init_process_group("gloo")
    for masks, shape in itertools.product(MASKS, SHAPES):
        rewards, data = step_batch(masks)
        shard = slice(rank * 2 * PAIRS // world, (rank + 1) * 2 * PAIRS // world)
        counts = torch.tensor([valid_seqs(rows(data, shard))], dtype=F64)
        dist.all_reduce(counts)  # the step's global sequence count, as NeMo RL's all-reduce before the loss
        loss, grad, metrics = accumulate(rewards[shard], rows(data, shard), 3, float(counts), shape)
        full_grad = torch.zeros_like(rewards)
        full_grad[shard] = grad
        names = sorted(metrics)
        summed = torch.cat([loss.detach().reshape(1), full_grad,
                            torch.tensor([metrics[k] for k in names], dtype=F64)])
        dist.all_reduce(summed)  # SUM over ranks: every share is already divided by the global count
        n = rewards.numel()
        got = (summed[0], summed[1:1 + n], dict(zip(names, summed[1 + n:].tolist())))
        assert_matches(got, expected(rewards, data), f"rank {rank} {masks} {shape}")


def test_losses_summed_over_two_gloo_ranks_match_the_single_process_reference():
    run_ranks(2, _rank, 2)


def test_reference_is_the_bradley_terry_likelihood_for_one_pair():
    """The slow reference itself, on numbers worked by hand: P(chosen ≻ rejected) = σ(r_c - r_j)."""
    with torch.no_grad():
        loss, metrics = reference(torch.tensor([1.5, -0.5], dtype=F64),
                                  PreferenceInputs(sample_mask=torch.ones(2, dtype=torch.bool)))
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-2.0))), rel=1e-6)
    assert metrics["rewards_chosen_mean"] == pytest.approx(1.5) and metrics["accuracy"] == pytest.approx(1.0)

"""dpo_loss (NeMo RL's DPOLossFn) against a slow pair-by-pair, token-by-token float64 reference, for every
combination of its options: values, metrics and gradients, whole, in micro-batches and over 2 gloo ranks."""

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loss_parity import assert_matches

from services.trainer.algorithms import DPOInputs, DPOLossConfig, dpo_loss
from services.trainer.algorithms.metrics import combine_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_harness import run_ranks  # noqa: E402

F64 = torch.float64
EPS = 1e-8
PAIRS, LENGTH = 4, 6
MASKS = ["all_valid", "masked_pair"]
OPTIONS = list(itertools.product([0.05, 0.5], [1.0, 0.3], [0.0, 0.7], [False, True], [False, True]))
"""(reference_policy_kl_penalty, preference_loss_weight, sft_loss_weight, preference_average_log_probs,
sft_average_log_probs): every combination of the booleans, two values of each number."""


def config(option) -> DPOLossConfig:
    beta, w_pref, w_sft, pref_avg, sft_avg = option
    return DPOLossConfig(reference_policy_kl_penalty=beta, preference_loss_weight=w_pref,
                         sft_loss_weight=w_sft, preference_average_log_probs=pref_avg,
                         sft_average_log_probs=sft_avg)


def step_batch(masks: str, seed: int = 0) -> tuple[torch.Tensor, DPOInputs]:
    """2·PAIRS rows, chosen at even and rejected at odd indices, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    logprobs = -3 * torch.rand(rows, LENGTH, generator=g, dtype=F64)
    reference = logprobs + 0.5 * torch.randn(rows, LENGTH, generator=g, dtype=F64)
    token_mask = torch.rand(rows, LENGTH, generator=g) < 0.7
    token_mask[:, 0] = True
    # Pair 1 is a tie: the same response twice.
    logprobs[3], reference[3], token_mask[3] = logprobs[2], reference[2], token_mask[2]
    sample_mask = torch.ones(rows, dtype=torch.bool)
    if masks == "masked_pair":
        sample_mask[4:6] = False  # pair 2 carries no loss
        token_mask[6] = False  # pair 3's chosen response has no token (averages divide by at least 1)
    return logprobs, DPOInputs(reference_logprobs=reference, token_mask=token_mask, sample_mask=sample_mask)


def reference(logprobs, data, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """NeMo RL's DPO formulas, one pair and one token at a time."""

    def reward(i):
        tokens = [t for t in range(logprobs.shape[1]) if data.token_mask[i, t]]
        total = torch.zeros((), dtype=F64)
        for t in tokens:
            total = total + logprobs[i, t] - data.reference_logprobs[i, t]
        return total / max(1, len(tokens)) if cfg.preference_average_log_probs else total

    def nll(i):
        tokens = [t for t in range(logprobs.shape[1]) if data.token_mask[i, t]]
        total = torch.zeros((), dtype=F64)
        for t in tokens:
            total = total - logprobs[i, t]
        return total / max(1, len(tokens)) if cfg.sft_average_log_probs else total

    pref, sft, acc, chosen_sum, rejected_sum, pairs = 0.0, 0.0, 0.0, 0.0, 0.0, 0
    for k in range(logprobs.shape[0] // 2):
        if not data.sample_mask[2 * k]:
            continue
        chosen, rejected = reward(2 * k), reward(2 * k + 1)
        pref = pref + torch.log(1 + torch.exp(-cfg.reference_policy_kl_penalty * (chosen - rejected)))
        sft = sft + nll(2 * k)
        acc += float(chosen > rejected)
        chosen_sum, rejected_sum = chosen_sum + chosen.item(), rejected_sum + rejected.item()
        pairs += 1
    n = pairs + EPS
    sft_loss = sft / n if cfg.sft_loss_weight > 0 else torch.zeros((), dtype=F64)
    loss = cfg.sft_loss_weight * sft_loss + cfg.preference_loss_weight * pref / n
    return loss, {"loss": loss.item(), "sft_loss": sft_loss.item(), "preference_loss": (pref / n).item(),
                  "accuracy": acc / n, "rewards_chosen_mean": chosen_sum / n,
                  "rewards_rejected_mean": rejected_sum / n,
                  "num_valid_samples": pairs}


def valid_seqs(data: DPOInputs) -> float:
    return float(data.sample_mask.sum())


def rows(data: DPOInputs, part: slice) -> DPOInputs:
    return DPOInputs(**{name: getattr(data, name)[part] for name in DPOInputs.__slots__})


def accumulate(logprobs, data, cfg, micro_batches: int, global_valid_seqs: float):
    """(Σ micro-batch losses, gradient w.r.t. logprobs, combined metrics); pairs stay whole."""
    leaf = logprobs.detach().clone().requires_grad_(True)
    size = logprobs.shape[0] // micro_batches
    total, metrics = 0.0, {}
    for start in range(0, logprobs.shape[0], size):
        part = slice(start, start + size)
        loss, m = dpo_loss(leaf[part], rows(data, part), cfg, global_valid_seqs=global_valid_seqs)
        total, metrics = total + loss, combine_metrics(metrics, m)
    (grad,) = torch.autograd.grad(total, leaf)
    return total, grad, metrics


def expected(logprobs, data, cfg):
    leaf = logprobs.detach().clone().requires_grad_(True)
    loss, metrics = reference(leaf, data, cfg)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("option", OPTIONS)
def test_dpo_loss_value_metrics_and_gradient_match_the_pairwise_reference(option, masks):
    logprobs, data = step_batch(masks)
    got = accumulate(logprobs, data, config(option), 1, valid_seqs(data))
    assert_matches(got, expected(logprobs, data, config(option)))
    assert got[1].abs().max() > 1e-5  # the gradient is not trivially zero
    assert 0 < got[2]["accuracy"] < 1  # the tie counts as wrong: [r_chosen > r_rejected] is strict


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("option", OPTIONS)
def test_micro_batch_losses_with_the_step_sequence_count_sum_to_the_whole_batch_loss(option, micro_batches):
    logprobs, data = step_batch("masked_pair")
    got = accumulate(logprobs, data, config(option), micro_batches, valid_seqs(data))
    assert_matches(got, expected(logprobs, data, config(option)))


def test_dpo_loss_refuses_an_odd_number_of_rows():
    logprobs, data = step_batch("all_valid")
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(logprobs[:3], rows(data, slice(0, 3)), DPOLossConfig(), global_valid_seqs=3.0)


def _rank(rank: int, world: int) -> None:
    dist.init_process_group("gloo")
    for masks, option in itertools.product(MASKS, OPTIONS):
        logprobs, data = step_batch(masks)
        shard = slice(rank * 2 * PAIRS // world, (rank + 1) * 2 * PAIRS // world)
        counts = torch.tensor([valid_seqs(rows(data, shard))], dtype=F64)
        dist.all_reduce(counts)  # the step's global sequence count, as NeMo RL's all-reduce before the loss
        loss, grad, metrics = accumulate(logprobs[shard], rows(data, shard), config(option), 2, float(counts))
        full_grad = torch.zeros_like(logprobs)
        full_grad[shard] = grad
        names = sorted(metrics)
        summed = torch.cat([loss.detach().reshape(1), full_grad.flatten(),
                            torch.tensor([metrics[k] for k in names], dtype=F64)])
        dist.all_reduce(summed)  # SUM over ranks: every share is already divided by the global count
        got = (summed[0], summed[1:1 + logprobs.numel()].reshape(logprobs.shape),
               dict(zip(names, summed[1 + logprobs.numel():].tolist())))
        assert_matches(got, expected(logprobs, data, config(option)), f"rank {rank} {masks} {option}")


def test_losses_summed_over_two_gloo_ranks_match_the_single_process_reference():
    run_ranks(2, _rank, 2)


def test_reference_is_the_textbook_dpo_loss_for_one_pair():
    """The slow reference itself, on numbers worked by hand: -log σ(β·((lc - rc) - (lj - rj)))."""
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=F64)
    data = DPOInputs(reference_logprobs=torch.tensor([[-1.5, -2.0], [-1.0, -1.0]], dtype=F64),
                     token_mask=torch.ones(2, 2, dtype=torch.bool),
                     sample_mask=torch.ones(2, dtype=torch.bool))
    margin = (-3.0 - -3.5) - (-3.5 - -2.0)  # 2.0
    with torch.no_grad():
        loss, metrics = reference(logprobs, data, DPOLossConfig(reference_policy_kl_penalty=0.1))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1 * margin)), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(1.0)

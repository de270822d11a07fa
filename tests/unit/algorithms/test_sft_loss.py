"""nll_loss (NeMo RL's NLLLossFn) against a slow token-by-token float64 reference: values, metrics and
gradients, whole, cut into micro-batches, and over 2 gloo ranks."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loss_parity import assert_matches

from services.trainer.algorithms import NLLInputs, nll_loss
from services.trainer.algorithms.metrics import combine_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_harness import run_ranks  # noqa: E402

F64 = torch.float64
EPS = 1e-8
ROWS, LENGTH = 6, 7
MASKS = ["all_valid", "masked_rows", "float_masks"]


def step_batch(masks: str, seed: int = 0) -> tuple[torch.Tensor, NLLInputs]:
    """One optimizer step's rows: target-token logprobs and masks, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -3 * torch.rand(ROWS, LENGTH, generator=g, dtype=F64)
    token_mask = torch.rand(ROWS, LENGTH, generator=g) < 0.7
    token_mask[:, 0] = True
    sample_mask = torch.ones(ROWS, dtype=torch.bool)
    if masks != "all_valid":
        token_mask[2] = False  # a row with no assistant token
        sample_mask[4] = False  # a row kept out of the loss (loss_multiplier 0)
    if masks == "float_masks":
        return logprobs, NLLInputs(token_mask=token_mask.double(), sample_mask=sample_mask.double())
    return logprobs, NLLInputs(token_mask=token_mask, sample_mask=sample_mask)


def reference(logprobs: torch.Tensor, data: NLLInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """-mean of the logprobs of every valid token of the step, one token at a time."""
    total, tokens = torch.zeros((), dtype=F64), 0
    for i in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if data.token_mask[i, t] and data.sample_mask[i]:
                total = total - logprobs[i, t]
                tokens += 1
    loss = total / (tokens + EPS)
    return loss, {"loss": loss.item(), "num_unmasked_tokens": tokens,
                  "num_valid_samples": sum(bool(m) for m in data.sample_mask)}


def valid_tokens(data: NLLInputs) -> float:
    return float((data.token_mask.bool() & data.sample_mask.bool()[:, None]).sum())


def rows(data: NLLInputs, part: slice) -> NLLInputs:
    return NLLInputs(token_mask=data.token_mask[part], sample_mask=data.sample_mask[part])


def accumulate(logprobs, data, micro_batches: int, global_valid_tokens: float):
    """(Σ micro-batch losses, gradient w.r.t. logprobs, combined metrics)."""
    leaf = logprobs.detach().clone().requires_grad_(True)
    size = logprobs.shape[0] // micro_batches
    total, metrics = 0.0, {}
    for start in range(0, logprobs.shape[0], size):
        part = slice(start, start + size)
        loss, m = nll_loss(leaf[part], rows(data, part), global_valid_tokens=global_valid_tokens)
        total, metrics = total + loss, combine_metrics(metrics, m)
    (grad,) = torch.autograd.grad(total, leaf)
    return total, grad, metrics


def expected(logprobs, data):
    leaf = logprobs.detach().clone().requires_grad_(True)
    loss, metrics = reference(leaf, data)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


@pytest.mark.parametrize("masks", MASKS)
def test_nll_loss_value_metrics_and_gradient_match_the_token_by_token_reference(masks):
    logprobs, data = step_batch(masks)
    got = accumulate(logprobs, data, 1, valid_tokens(data))
    assert_matches(got, expected(logprobs, data))
    assert got[1].abs().max() > 1e-3


@pytest.mark.parametrize("micro_batches", [2, 3, 6])
@pytest.mark.parametrize("masks", MASKS)
def test_micro_batch_losses_with_the_step_token_count_sum_to_the_whole_batch_loss(masks, micro_batches):
    logprobs, data = step_batch(masks)
    got = accumulate(logprobs, data, micro_batches, valid_tokens(data))
    assert_matches(got, expected(logprobs, data))


def _rank(rank: int, world: int) -> None:
    dist.init_process_group("gloo")
    for masks in MASKS:
        logprobs, data = step_batch(masks)
        shard = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
        counts = torch.tensor([valid_tokens(rows(data, shard))], dtype=F64)
        dist.all_reduce(counts)  # the step's global token count, as NeMo RL's all-reduce before the loss
        loss, grad, metrics = accumulate(logprobs[shard], rows(data, shard), 3, float(counts))
        full_grad = torch.zeros_like(logprobs)
        full_grad[shard] = grad
        summed = torch.cat([loss.detach().reshape(1), full_grad.flatten(),
                            torch.tensor([metrics[k] for k in sorted(metrics)], dtype=F64)])
        dist.all_reduce(summed)  # SUM over ranks: every share is already divided by the global count
        got = (summed[0], summed[1:1 + logprobs.numel()].reshape(logprobs.shape),
               dict(zip(sorted(metrics), summed[1 + logprobs.numel():].tolist())))
        assert_matches(got, expected(logprobs, data), f"rank {rank} {masks}")


def test_losses_summed_over_two_gloo_ranks_match_the_single_process_reference():
    run_ranks(2, _rank, 2)

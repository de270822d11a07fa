"""One SFT, DPO or RM step (and a validation pass) on the FSDP2 backend's model, optimizer and ranks.

    SFT: rows ─▶ micro-batches (train_plan: ranks r::dp, token budgets) ─▶ nll_loss / Σ valid tokens of the step
    DPO: pairs ─▶ rank r takes pairs r::dp ─▶ micro-batches of train_micro_batch_size pairs (rows 2k, 2k+1 together)
         ─▶ the frozen reference's logprobs of every micro-batch first (once per batch), then dpo_loss / Σ valid rows

The step is one optimizer step over the whole batch (NeMo RL's SFT and DPO loops take one per batch).
Every rank runs the same number of micro-batches (empty ones where it has no rows), since FSDP's forward
and backward are collectives; the loss is multiplied by dp because FSDP averages gradients over ranks,
so ranks sum, as fsdp2.py does for GRPO. Logprobs are at temperature 1 (no sampling to match).
RM: pairs as DPO's, each row scored by the scalar head (reward_head.py), rm.preference_loss over the step's rows.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor

from services.common.config_offline import loss_keys
from services.trainer.algorithms import (DPOInputs, DPOLossConfig, NLLInputs, PreferenceInputs, dpo_loss, nll_loss,
                                         preference_loss)
from services.trainer.algorithms.metrics import combine_metrics
from services.trainer.backends.reward_head import scores
from services.trainer.backends.tensor_parallel import sum_over_tp
from services.trainer.batch import TrainBatch
from services.trainer.lora import adapters_off
from services.trainer.plan import lockstep, split_by_count, train_plan


def pair_plan(n_rows: int, rank: int, world: int, micro_pairs: int) -> list[list[int]]:
    """This rank's micro-batches of whole pairs (rows 2k and 2k+1), padded with empty ones to the most any rank has."""
    per_rank = [[[row for k in chunk for row in (2 * k, 2 * k + 1)]
                 for chunk in split_by_count(list(range(n_rows // 2))[r::world], micro_pairs)] for r in range(world)]
    return lockstep(per_rank, rank)


def _filler(be) -> list[int]:
    """The rows an empty micro-batch runs (its loss times 0) to join the collectives: one pair for DPO."""
    return [0] if be.cfg.algorithm == "sft" else [0, 1]


def micro_batches(be, b: TrainBatch, micro: int) -> list[list[int]]:
    if be.cfg.algorithm == "sft":
        lengths = b.attention_mask.sum(1).tolist()
        return train_plan(lengths, be.dp_rank, be.dp, global_batch=None, micro=micro,
                          budget=be.forward.budget(train=True))[0]
    return pair_plan(len(b), be.dp_rank, be.dp, micro)


@torch.no_grad()
def reference_logprobs(be, b: TrainBatch, plan: list[list[int]]) -> Tensor:
    """[B, L-1] the frozen reference's logprobs of this rank's rows: the initial weights' copy, or with LoRA the
    policy with its adapters off."""
    out = torch.zeros(b.targets.shape, dtype=torch.float32)
    model = be.reference if be.reference is not None else be.model
    with adapters_off(be.model) if be.reference is None else contextlib.nullcontext():
        for rows in plan:
            values = be.forward.logprobs(model, b, rows or _filler(be))
            if rows:
                out[rows, : values.shape[1]] = values.float().cpu()
    return out


def forward(be, b: TrainBatch, rows: list[int]) -> Tensor:
    """The policy's logprobs of the rows' tokens [rows, width - 1], or for rm the head's scores [rows]."""
    if be.cfg.algorithm == "rm":
        return scores(be.model, b, rows, be.device)
    return be.forward.logprobs(be.model, b, rows)


def micro_loss(be, curr: Tensor, b: TrainBatch, rows: list[int], ref: Tensor | None, totals: dict[str, float]):
    """(loss, metrics) of one micro-batch by the run's algorithm."""
    if be.cfg.algorithm == "rm":
        return preference_loss(curr, PreferenceInputs(sample_mask=b.sample_mask[rows].to(curr.device)),
                               global_valid_seqs=totals["global_valid_seqs"])
    width = curr.shape[1]
    token_mask = b.token_mask[rows, :width].to(curr.device)
    sample_mask = b.sample_mask[rows].to(curr.device)
    if be.cfg.algorithm == "sft":
        return nll_loss(curr, NLLInputs(token_mask=token_mask, sample_mask=sample_mask),
                        global_valid_tokens=totals["global_valid_tokens"])
    data = DPOInputs(reference_logprobs=ref[rows, :width].to(curr.device), token_mask=token_mask,
                     sample_mask=sample_mask)
    return dpo_loss(curr, data, DPOLossConfig(**loss_keys(be.cfg.dpo)), global_valid_seqs=totals["global_valid_seqs"])


def totals_of(b: TrainBatch) -> dict[str, float]:
    mask = b.token_mask * b.sample_mask[:, None]
    return dict(global_valid_tokens=max(1.0, mask.sum().item()), global_valid_seqs=max(1.0, b.sample_mask.sum().item()))


def offline_step(be, b: TrainBatch) -> dict[str, float]:
    """One optimizer step on the whole batch; metrics the same on every rank."""
    from services.trainer.backends.fsdp2 import _combine_over_ranks, clip_grad_norm

    p = be.cfg.policy
    t0 = time.perf_counter()
    plan = micro_batches(be, b, p.train_micro_batch_size)
    with be.optimizer_offloaded():
        ref = reference_logprobs(be, b, plan) if be.cfg.algorithm == "dpo" else None
    t1 = time.perf_counter()
    totals = totals_of(b)
    be.optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, float] = {}
    be.model.train()
    try:
        for rows in plan:
            curr = forward(be, b, rows or _filler(be))
            loss, m = micro_loss(be, curr, b, rows or _filler(be), ref, totals)
            (loss * (be.dp if rows else 0.0)).backward()  # an empty micro-batch only joins the collectives
            if rows:
                metrics = combine_metrics(metrics, m)
    finally:
        be.model.eval()
    sum_over_tp(be.tp_summed, be.mesh["tp"])
    metrics = _combine_over_ranks(metrics, be.mesh["dp"])
    norm = clip_grad_norm(list(be.model.parameters()), p.max_grad_norm or float("inf"))
    metrics["lr"] = be.optimizer.param_groups[0]["lr"]
    be.optimizer.step()
    be.optimizer.zero_grad(set_to_none=True)  # freed now, not at the next step
    be.scheduler.step()
    return metrics | {"grad_norm": float(norm), "timing/train/logprobs": t1 - t0,
                      "timing/train/optimizer": time.perf_counter() - t1}


@torch.no_grad()
def offline_validate(be, b: TrainBatch) -> dict[str, float]:
    """The step's loss and metrics on a validation batch, no update: NeMo RL's validate() for SFT and DPO."""
    plan = micro_batches(be, b, be.cfg.offline.val_micro_batch_size)
    ref = reference_logprobs(be, b, plan) if be.cfg.algorithm == "dpo" else None
    totals = totals_of(b)
    metrics: dict[str, float] = {}
    for rows in plan:
        curr = forward(be, b, rows or _filler(be))
        _, m = micro_loss(be, curr, b, rows or _filler(be), ref, totals)
        if rows:
            metrics = combine_metrics(metrics, m)
    return _combine(be, metrics)


def _combine(be, metrics: dict[str, float]) -> dict[str, float]:
    from services.trainer.backends.fsdp2 import _combine_over_ranks

    return _combine_over_ranks(metrics, be.mesh["dp"])

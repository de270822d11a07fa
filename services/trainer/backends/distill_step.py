"""One on-policy distillation step on the FSDP2 backend's model, optimizer and ranks.

    batch (student samples + the teacher's top-k, batch.py) ─▶ optimizer steps of train_global_batch_size rows
        ─▶ rank r takes rows r::dp ─▶ micro-batches (train_plan: counts or token budgets)
        ─▶ student logits [rows, T, V] ─▶ distillation_loss / Σ valid tokens of the optimizer step

As GRPO's step (fsdp2.py): each micro-batch's loss is divided by the optimizer step's GLOBAL valid tokens
(token_mask · sample_mask over all its rows, whichever rank runs them), so the shares add up to the step's
token mean (NeMo RL's global_valid_toks); the loss is multiplied by dp because FSDP averages gradients over
ranks, so ranks sum. Every rank runs the same number of micro-batches (an empty one runs a row with loss × 0).
The student's temperature is policy.generation.temperature, the one it sampled with; the teacher's is
teacher.generation.temperature, which NeMo RL's teacher divides its logits by before its top-k.

Environment reward (Flywheel's distillation.env_reward_weight w, 0 by default as NeMo RL has none): each micro-batch
adds w × GRPO's clipped policy-gradient share (algorithms/loss.py, loss_fn's defaults, the batch's GRPO advantages)
computed from the same forward, normalised over the same optimizer step's tokens and sequences. Its ratio is taken
against that forward, detached (prev = current, as force_on_policy_ratio), in every optimizer step of the trainer step.
"""

from __future__ import annotations

import time

from torch import Tensor

from services.common.modeling import token_logprobs
from services.trainer.algorithms import (DistillationInputs, DistillationLossConfig, LossInputs, clipped_pg_loss,
                                         distillation_loss)
from services.trainer.algorithms.metrics import combine_metrics
from services.trainer.backends.tensor_parallel import sum_over_tp
from services.trainer.batch import TrainBatch
from services.trainer.plan import optimizer_steps, train_plan


def loss_config(be) -> DistillationLossConfig:
    f = be.cfg.loss_fn
    return DistillationLossConfig(kl_type=f.kl_type, mixed_kl_weight=f.mixed_kl_weight,
                                  zero_outside_topk=f.zero_outside_topk)


def micro_inputs(b: TrainBatch, rows: list[int], width: int, device) -> DistillationInputs:
    """The rows' teacher top-k and masks, cut to the micro-batch's width (its targets)."""
    return DistillationInputs(teacher_topk_logits=b.teacher_topk_logits[rows, :width].to(device),
                              teacher_topk_indices=b.teacher_topk_indices[rows, :width].to(device),
                              token_mask=b.token_mask[rows, :width].to(device),
                              sample_mask=b.sample_mask[rows].to(device))


def micro_loss(be, b: TrainBatch, rows: list[int], totals: dict[str, float], advantages: Tensor | None
               ) -> tuple[Tensor, dict[str, float]]:
    logits = be.forward.logits(be.model, b, rows)
    temperature = be.cfg.policy.generation.temperature
    kl, metrics = distillation_loss(logits, micro_inputs(b, rows, logits.shape[1], logits.device), loss_config(be),
                                    global_valid_tokens=totals["global_valid_tokens"],
                                    student_temperature=temperature,
                                    teacher_temperature=be.cfg.teacher.generation.temperature)
    if advantages is None:
        return kl, metrics
    width = logits.shape[1]
    curr = token_logprobs(logits, b.targets[rows, :width].to(logits.device), temperature)
    data = LossInputs(prev_logprobs=None, generation_logprobs=b.generation_logprobs, reference_logprobs=None,
                      advantages=advantages, token_mask=b.token_mask, sample_mask=b.sample_mask)
    pg, pg_metrics = clipped_pg_loss(curr, be.forward.loss_inputs(data, rows, width), be.cfg.loss_fn,
                                     global_valid_tokens=max(1.0, totals["global_valid_tokens"]),  # as GRPO's step
                                     global_valid_seqs=totals["global_valid_seqs"])
    loss = kl + be.cfg.distillation.env_reward_weight * pg
    return loss, {**{f"env_reward/{k}": v for k, v in pg_metrics.items()}, "kl_loss": metrics["loss"],
                  "loss": loss.item(), "num_valid_samples": metrics["num_valid_samples"]}


def optimizer_step(be, b: TrainBatch, chunk: list[int], micro_batches: list[list[int]], advantages: Tensor | None
                   ) -> dict[str, float]:
    from services.trainer.backends.fsdp2 import _combine_over_ranks, clip_grad_norm

    totals = dict(global_valid_tokens=(b.token_mask[chunk] * b.sample_mask[chunk, None]).sum().item(),
                  global_valid_seqs=max(1.0, b.sample_mask[chunk].sum().item()))
    be.optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, float] = {}
    for rows in micro_batches:
        loss, m = micro_loss(be, b, rows or [chunk[0]], totals, advantages)
        (loss * (be.dp if rows else 0.0)).backward()  # FSDP averages over dp; an empty micro-batch adds 0
        if rows:
            metrics = combine_metrics(metrics, m)
    sum_over_tp(be.tp_summed, be.mesh["tp"])
    metrics = _combine_over_ranks(metrics, be.mesh["dp"])
    norm = clip_grad_norm(list(be.model.parameters()), be.cfg.policy.max_grad_norm or float("inf"))
    metrics["lr"] = be.optimizer.param_groups[0]["lr"]
    be.optimizer.step()
    be.optimizer.zero_grad(set_to_none=True)  # freed now, not at the next step
    return metrics | {"grad_norm": float(norm)}


def distill_step(be, b: TrainBatch, advantages: Tensor | None = None) -> dict[str, float]:
    """One trainer step: its optimizer steps (train_global_batch_size rows each), then one scheduler step.
    advantages: [B] GRPO advantages when distillation.env_reward_weight > 0, else None."""
    from services.trainer.backends.fsdp2 import _mean_over_steps

    if b.teacher_topk_logits is None:
        raise ValueError("a distillation step needs the batch built with the teacher's top-k (build_batch teacher_k)")
    p = be.cfg.policy
    t0 = time.perf_counter()
    lengths = b.attention_mask.sum(1).tolist()
    plan = train_plan(lengths, be.dp_rank, be.dp, global_batch=p.train_global_batch_size,
                      micro=p.train_micro_batch_size, budget=be.forward.budget(train=True))
    be.model.train()
    try:
        reports = [optimizer_step(be, b, list(chunk), micro_batches, advantages)
                   for chunk, micro_batches in zip(optimizer_steps(len(b), p.train_global_batch_size), plan)]
    finally:
        be.model.eval()
    be.scheduler.step()
    return _mean_over_steps(reports) | {"timing/train/optimizer": time.perf_counter() - t0}

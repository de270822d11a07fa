"""On-policy distillation: NeMo RL's DistillationLossFn (nemo_rl/algorithms/loss/loss_functions.py),
with the top-k gathering of nemo_rl/distributed/model_utils.py's get_distillation_topk_logprobs_from_logits.

The teacher sends, at every position, its k largest logits z and their token ids I (NeMo RL's
`topk_logits_k`). Per position, with s the student's full logits, Ts and Tt the student's and
teacher's sampling temperatures (policy.generation.temperature, teacher.generation.temperature):

    t_j = softmax_j(z / Tt)                         teacher, always renormalised over its top-k
    q_j = softmax(s / Ts)[I_j]                      zero_outside_topk: the student's full-vocab probs
        = softmax_j(s[I] / Ts)                      otherwise: renormalised over the teacher's top-k
    F   = Σ_j t_j (log t_j - log q_j)               forward KL(teacher ‖ student) over the top-k
    R   = Σ_j q_j (log q_j - log t_j)               reverse KL(student ‖ teacher) over the top-k
        + Σ_{v ∉ I} p_v (log p_v + 100)             only with zero_outside_topk: the teacher's logprob
                                                    outside its top-k is log ε = -100, p = softmax(s / Ts)
    kl  = F (forward) | R (reverse) | w·F + (1-w)·R (mixed, w = mixed_kl_weight)

    loss = Σ_{i,t} kl[i,t] · token_mask · sample_mask / (N_tok + 1e-8)

N_tok = Σ token_mask · sample_mask over the WHOLE optimizer step (all micro-batches and data-parallel
ranks, NeMo RL's `global_valid_toks`), so micro-batch losses are shares that add up to the step's
token mean and ranks SUM gradients. The outside-top-k term is computed as NeMo RL does, from the
student's full negative entropy: Σ_v p log p - Σ_j q log q + 100·(1 - Σ_j q).

Inputs are aligned with the target tokens: entry [i, t] is the position that predicts target token t
(NeMo RL drops the last position and shifts token_mask by one before this point). Student logprobs
may be passed for logits: softmax is unchanged by a per-position shift, at any temperature.
The teacher's logits arrive UNSCALED; this module divides them by Tt (NeMo RL's teacher scales
before its top-k, which gives the same top-k set and the same t). Metrics use NeMo RL's names and
combine by sum: `loss` (the share), `num_valid_samples` (rows in the micro-batch, as NeMo RL counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

EPS = 1e-8
"""Added to the global normaliser, as NeMo RL's masked_mean does."""
LOG_INFINITESIMAL = -100.0
"""The teacher's logprob assumed outside its top-k under zero_outside_topk (NeMo RL's log_infinitesimal)."""
KL_TYPES = ("forward", "reverse", "mixed")


@dataclass(kw_only=True, slots=True)
class DistillationLossConfig:
    """NeMo RL's `loss_fn:` keys for distillation (DistillationLossConfig), with its defaults."""

    kl_type: str = "mixed"
    """forward KL(teacher ‖ student), reverse KL(student ‖ teacher), or mixed."""
    mixed_kl_weight: float = 0.5
    """Weight of the forward KL under kl_type mixed, in [0, 1]; the reverse KL gets 1 - w."""
    zero_outside_topk: bool = False
    """Student probs over the full vocabulary and the teacher as zero outside its top-k (see above)."""

    def __post_init__(self) -> None:
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"loss_fn.kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if not 0.0 <= self.mixed_kl_weight <= 1.0:
            raise ValueError(f"loss_fn.mixed_kl_weight must be in [0, 1], got {self.mixed_kl_weight}")


@dataclass(kw_only=True, slots=True)
class DistillationInputs:
    """One micro-batch of B rows padded to T target tokens, with the teacher's top-k at each.

    Padding positions are masked by multiplication, as NeMo RL does, so they must still hold finite
    logits and valid token ids (zeros will do): a -inf there would turn the loss into NaN.
    """

    teacher_topk_logits: Tensor
    """[B, T, k] float: the teacher's k largest logits at each position, before temperature."""
    teacher_topk_indices: Tensor
    """[B, T, k] int64: their token ids in the shared vocabulary."""
    token_mask: Tensor
    """[B, T] bool or 0/1: tokens that carry loss (generated tokens, not prompt or padding)."""
    sample_mask: Tensor
    """[B] bool or 0/1: rows that carry loss (NeMo RL's loss_multiplier)."""


def topk_logprobs(student_logits: Tensor, data: DistillationInputs, cfg: DistillationLossConfig, *,
                  student_temperature: float, teacher_temperature: float
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log q [B,T,k], log t [B,T,k], Σ_v p log p [B,T] or None when R needs no outside term)."""
    # At least float32, as NeMo RL casts the student logits; float64 stays float64 (tests).
    logits = student_logits.to(torch.promote_types(student_logits.dtype, torch.float32))
    logits = logits / student_temperature
    index = data.teacher_topk_indices.to(logits.device)
    neg_entropy = None
    if cfg.zero_outside_topk:
        full = torch.log_softmax(logits, dim=-1)
        student = full.gather(-1, index)
        if cfg.kl_type != "forward":
            neg_entropy = (full.exp() * full).sum(-1)
    else:
        student = torch.log_softmax(logits.gather(-1, index), dim=-1)
    teacher = torch.log_softmax(data.teacher_topk_logits.to(student) / teacher_temperature, dim=-1)
    return student, teacher, neg_entropy


def per_token_kl(student: Tensor, teacher: Tensor, neg_entropy: Tensor | None,
                 cfg: DistillationLossConfig) -> Tensor:
    """[B, T] kl from the top-k logprobs (and the student's negative entropy under zero_outside_topk)."""
    forward = (teacher.exp() * (teacher - student)).sum(-1)
    reverse = (student.exp() * (student - teacher)).sum(-1)
    if neg_entropy is not None:
        outside = 1.0 - student.exp().sum(-1)
        reverse = reverse + neg_entropy - (student.exp() * student).sum(-1) - LOG_INFINITESIMAL * outside
    if cfg.kl_type == "forward":
        return forward
    if cfg.kl_type == "reverse":
        return reverse
    return cfg.mixed_kl_weight * forward + (1.0 - cfg.mixed_kl_weight) * reverse


def distillation_loss(student_logits: Tensor, data: DistillationInputs, cfg: DistillationLossConfig, *,
                      global_valid_tokens: float, student_temperature: float, teacher_temperature: float
                      ) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step's token-mean KL to the teacher.

    student_logits: [B, T, V] with grad (or log_softmax of them). global_valid_tokens: Σ token_mask ·
    sample_mask over the step. Temperatures: policy.generation.temperature and teacher.generation.temperature.
    """
    student, teacher, neg_entropy = topk_logprobs(student_logits, data, cfg,
                                                  student_temperature=student_temperature,
                                                  teacher_temperature=teacher_temperature)
    kl = per_token_kl(student, teacher, neg_entropy, cfg)
    mask = data.token_mask.to(kl.dtype) * data.sample_mask.to(kl.dtype)[:, None]
    loss = (kl * mask).sum() / (global_valid_tokens + EPS)
    return loss, {"loss": loss.item(), "num_valid_samples": float(student_logits.shape[0])}

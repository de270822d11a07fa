"""distillation_loss (NeMo RL's DistillationLossFn) against a slow token-by-token float64 reference and a
case worked by hand: values, metrics and gradients, for every kl_type × zero_outside_topk, whole, cut into
micro-batches, and over 2 gloo ranks."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from loss_parity import assert_matches

from services.trainer.algorithms import DistillationInputs, DistillationLossConfig, distillation_loss
from services.trainer.algorithms.metrics import combine_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_harness import run_ranks  # noqa: E402

F64 = torch.float64
EPS = 1e-8
ROWS, LENGTH, VOCAB, K = 6, 5, 11, 4
CONFIGS = [(kl, w, zero) for zero in (False, True)
           for kl, w in (("forward", 0.5), ("reverse", 0.5), ("mixed", 0.5), ("mixed", 0.2))]
TEMPERATURES = [(1.0, 1.0), (0.7, 1.3)]
"""(student, teacher): equal, and different on purpose so each must be applied to its own logits."""


def config(kl_type: str, weight: float, zero: bool) -> DistillationLossConfig:
    return DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=weight, zero_outside_topk=zero)


def step_batch(seed: int = 0) -> tuple[torch.Tensor, DistillationInputs]:
    """One optimizer step: student logits, the teacher's top-k and masks, identical in every process."""
    g = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(ROWS, LENGTH, VOCAB, generator=g, dtype=F64)
    teacher = 2 * torch.randn(ROWS, LENGTH, VOCAB, generator=g, dtype=F64)
    top = teacher.topk(K, dim=-1)
    token_mask = torch.rand(ROWS, LENGTH, generator=g) < 0.7
    token_mask[:, 0] = True
    token_mask[2] = False  # a row with no generated token
    sample_mask = torch.ones(ROWS, dtype=torch.bool)
    sample_mask[4] = False  # a row kept out of the loss (loss_multiplier 0)
    return student, DistillationInputs(teacher_topk_logits=top.values, teacher_topk_indices=top.indices,
                                       token_mask=token_mask, sample_mask=sample_mask)


def token_kl(s: list, z: list, idx: list, cfg: DistillationLossConfig, ts: float, tt: float):
    """kl at one position from NeMo RL's formulas, one vocabulary entry at a time."""
    norm = sum(torch.exp(x / ts) for x in s)
    p = [torch.exp(x / ts) / norm for x in s]  # student, full vocabulary
    tnorm = sum(math.exp(x / tt) for x in z)
    t = [math.exp(x / tt) / tnorm for x in z]  # teacher, renormalised over its top-k
    if cfg.zero_outside_topk:
        q = [p[v] for v in idx]
    else:
        knorm = sum(p[v] for v in idx)
        q = [p[v] / knorm for v in idx]  # student, renormalised over the teacher's top-k
    forward = sum(t[j] * (math.log(t[j]) - torch.log(q[j])) for j in range(len(idx)))
    reverse = sum(q[j] * (torch.log(q[j]) - math.log(t[j])) for j in range(len(idx)))
    if cfg.zero_outside_topk:  # the teacher's logprob is -100 at every token outside its top-k
        reverse = reverse + sum(p[v] * (torch.log(p[v]) + 100) for v in range(len(s)) if v not in idx)
    w = {"forward": 1.0, "reverse": 0.0, "mixed": cfg.mixed_kl_weight}[cfg.kl_type]
    return w * forward + (1 - w) * reverse


def reference(student: torch.Tensor, data: DistillationInputs, cfg, ts: float, tt: float):
    """Mean kl over every valid token of the step, one token at a time."""
    total, tokens = torch.zeros((), dtype=F64), 0
    for i in range(student.shape[0]):
        for t in range(student.shape[1]):
            if data.token_mask[i, t] and data.sample_mask[i]:
                total = total + token_kl(list(student[i, t]), data.teacher_topk_logits[i, t].tolist(),
                                         data.teacher_topk_indices[i, t].tolist(), cfg, ts, tt)
                tokens += 1
    loss = total / (tokens + EPS)
    return loss, {"loss": loss.item(), "num_valid_samples": student.shape[0]}


def valid_tokens(data: DistillationInputs) -> float:
    return float((data.token_mask.bool() & data.sample_mask.bool()[:, None]).sum())


def rows(data: DistillationInputs, part: slice) -> DistillationInputs:
    return DistillationInputs(teacher_topk_logits=data.teacher_topk_logits[part],
                              teacher_topk_indices=data.teacher_topk_indices[part],
                              token_mask=data.token_mask[part], sample_mask=data.sample_mask[part])


def accumulate(student, data, cfg, temps, micro_batches: int, global_valid_tokens: float):
    """(Σ micro-batch losses, gradient w.r.t. the student logits, combined metrics)."""
    leaf = student.detach().clone().requires_grad_(True)
    size = student.shape[0] // micro_batches
    total, metrics = 0.0, {}
    for start in range(0, student.shape[0], size):
        part = slice(start, start + size)
        loss, m = distillation_loss(leaf[part], rows(data, part), cfg,
                                    global_valid_tokens=global_valid_tokens,
                                    student_temperature=temps[0], teacher_temperature=temps[1])
        total, metrics = total + loss, combine_metrics(metrics, m)
    (grad,) = torch.autograd.grad(total, leaf)
    return total, grad, metrics


def expected(student, data, cfg, temps):
    leaf = student.detach().clone().requires_grad_(True)
    loss, metrics = reference(leaf, data, cfg, *temps)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


@pytest.mark.parametrize("temps", TEMPERATURES)
@pytest.mark.parametrize("kl_type,weight,zero", CONFIGS)
def test_distillation_loss_value_metrics_and_gradient_match_the_token_by_token_reference(
        kl_type, weight, zero, temps):
    student, data = step_batch()
    cfg = config(kl_type, weight, zero)
    got = accumulate(student, data, cfg, temps, 1, valid_tokens(data))
    assert_matches(got, expected(student, data, cfg, temps))
    assert got[1].abs().max() > 1e-3


@pytest.mark.parametrize("micro_batches", [2, 3, 6])
@pytest.mark.parametrize("kl_type,weight,zero", CONFIGS)
def test_micro_batch_losses_with_the_step_token_count_sum_to_the_whole_batch_loss(
        kl_type, weight, zero, micro_batches):
    student, data = step_batch()
    cfg = config(kl_type, weight, zero)
    got = accumulate(student, data, cfg, TEMPERATURES[1], micro_batches, valid_tokens(data))
    assert_matches(got, expected(student, data, cfg, TEMPERATURES[1]))


def test_student_logprobs_give_the_same_loss_and_gradient_as_its_logits():
    student, data = step_batch()
    for kl_type, weight, zero in CONFIGS:
        cfg = config(kl_type, weight, zero)
        leaf = student.detach().clone().requires_grad_(True)
        loss, _ = distillation_loss(torch.log_softmax(leaf, -1), data, cfg,
                                    global_valid_tokens=valid_tokens(data),
                                    student_temperature=0.7, teacher_temperature=1.3)
        (grad,) = torch.autograd.grad(loss, leaf)
        from_logits, grad_from_logits, _ = accumulate(student, data, cfg, (0.7, 1.3), 1, valid_tokens(data))
        assert_matches((loss, grad, {}), (from_logits, grad_from_logits, {}), str(cfg))


# Worked by hand: vocabulary 4, k 2. The student's probs are p = (.4, .3, .2, .1); the teacher's top-2 are
# tokens 0 and 2 with probs .6 and .2, renormalised to t = (3/4, 1/4). Renormalised over {0, 2} the student
# is q = (2/3, 1/3); with zero_outside_topk it stays q = (.4, .2), and tokens 1 and 3 add p (log p + 100).
HAND = {
    (False, "forward"): 0.75 * math.log(9 / 8) + 0.25 * math.log(3 / 4),
    (False, "reverse"): 2 / 3 * math.log(8 / 9) + 1 / 3 * math.log(4 / 3),
    (True, "forward"): 0.75 * math.log(15 / 8) + 0.25 * math.log(5 / 4),
    (True, "reverse"): 0.4 * math.log(8 / 15) + 0.2 * math.log(4 / 5)
    + 0.3 * (math.log(0.3) + 100) + 0.1 * (math.log(0.1) + 100),
}


def hand_batch(ts: float, tt: float) -> tuple[torch.Tensor, DistillationInputs]:
    """One row, two positions; the second is padding (masked) and holds junk. Logits are scaled by the
    temperatures so that, once divided by them, the probabilities are the ones above."""
    student = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]]], dtype=F64).log() * ts
    teacher = torch.tensor([[[0.6, 0.2], [0.9, 0.1]]], dtype=F64).log() * tt
    return student, DistillationInputs(teacher_topk_logits=teacher,
                                       teacher_topk_indices=torch.tensor([[[0, 2], [3, 1]]]),
                                       token_mask=torch.tensor([[1, 0]]), sample_mask=torch.tensor([1]))


@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("kl_type,weight", [("forward", 0.5), ("reverse", 0.5), ("mixed", 0.25)])
def test_tiny_case_matches_the_kl_worked_by_hand(kl_type, weight, zero, temps):
    student, data = hand_batch(*temps)
    forward, reverse = HAND[zero, "forward"], HAND[zero, "reverse"]
    want = {"forward": forward, "reverse": reverse, "mixed": 0.25 * forward + 0.75 * reverse}[kl_type]
    leaf = student.clone().requires_grad_(True)
    loss, metrics = distillation_loss(leaf, data, config(kl_type, weight, zero), global_valid_tokens=1.0,
                                      student_temperature=temps[0], teacher_temperature=temps[1])
    assert loss.item() == pytest.approx(want / (1 + EPS), rel=1e-9)
    assert metrics == {"loss": pytest.approx(want, rel=1e-7), "num_valid_samples": 1.0}
    if not zero and kl_type != "mixed":  # d/ds of a KL over softmax(s[I] / Ts), by hand
        (grad,) = torch.autograd.grad(loss, leaf)
        q, t = torch.tensor([2 / 3, 1 / 3], dtype=F64), torch.tensor([0.75, 0.25], dtype=F64)
        top = q - t if kl_type == "forward" else q * ((q / t).log() - reverse)
        want_grad = torch.zeros_like(student)
        want_grad[0, 0, [0, 2]] = top / temps[0]
        torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("bad", [{"kl_type": "jsd"}, {"mixed_kl_weight": 1.5}, {"mixed_kl_weight": -0.1}])
def test_config_outside_nemo_rls_choices_is_refused(bad):
    with pytest.raises(ValueError, match="loss_fn"):
        DistillationLossConfig(**bad)


def _rank(rank: int, world: int) -> None:
    dist.init_process_group("gloo")
    student, data = step_batch()
    shard = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    counts = torch.tensor([valid_tokens(rows(data, shard))], dtype=F64)
    dist.all_reduce(counts)  # the step's global token count, as NeMo RL's all-reduce before the loss
    for kl_type, weight, zero in CONFIGS:
        cfg = config(kl_type, weight, zero)
        loss, grad, metrics = accumulate(student[shard], rows(data, shard), cfg, TEMPERATURES[1], 3,
                                         float(counts))
        full_grad = torch.zeros_like(student)
        full_grad[shard] = grad
        summed = torch.cat([loss.detach().reshape(1), full_grad.flatten(),
                            torch.tensor([metrics[k] for k in sorted(metrics)], dtype=F64)])
        dist.all_reduce(summed)  # SUM over ranks: every share is already divided by the global count
        got = (summed[0], summed[1:1 + student.numel()].reshape(student.shape),
               dict(zip(sorted(metrics), summed[1 + student.numel():].tolist())))
        assert_matches(got, expected(student, data, cfg, TEMPERATURES[1]), f"rank {rank} {cfg}")


def test_losses_summed_over_two_gloo_ranks_match_the_single_process_reference():
    run_ranks(2, _rank, 2)

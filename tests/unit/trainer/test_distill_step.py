"""The distillation step on the tiny model: one step's update equals SGD on a slow token-by-token reference loss, on
1 or 2 gloo ranks, with sequence packing, and with a teacher.generation.temperature other than 1; repeated steps pull
the student towards a fixed teacher's top-k.

The reference shares nothing with the code under test but the model: each completion runs alone (no padding, no
batch), the teacher's row t is read straight from Completion.teacher at the sequence position that predicts
completion token t, and the KL is NeMo RL's formula written out per position in float64 (probabilities, then
renormalised by division), averaged over every generated token of the step.
"""

import pytest
import torch
from distill_harness import K, groups
from trainer_harness import run_ranks

from services.common.config import load_config
from services.common.modeling import build_tiny_tokenizer, load_policy
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.batch import batch_advantages, build_batch
from services.trainer.distributed import init_distributed

VOCAB = len(build_tiny_tokenizer())
BASE = ["++distillation.max_num_steps=3", "++teacher.model_name=tiny", "policy.train_micro_batch_size=3",
        "policy.generation.temperature=0.7", "loss_fn.kl_type=mixed", "loss_fn.mixed_kl_weight=0.3"]
SGD = ["policy.optimizer={name: SGD, kwargs: {lr: 1.0}}", "policy.max_grad_norm=null"]
PACKED = ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=20"]


def _train(rank: int, out: str, overrides: list[str], steps: int) -> None:
    cfg = load_config(None, BASE + overrides)
    backend = FSDP2Backend(cfg, init_distributed(120))
    batch = build_batch(groups(VOCAB), pad_id=backend.tokenizer.pad_token_id, teacher_k=K)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}  # one CPU rank hands out views
    metrics = [backend.distill_step(batch) for _ in range(steps)]
    state = backend.full_state_dict()
    if rank == 0:
        torch.save({"before": before, "state": state, "metrics": metrics}, out)


def position_kl(logits: torch.Tensor, z: list[float], idx: list[int], tt: float) -> torch.Tensor:
    """kl_type mixed (w = 0.3), zero_outside_topk false, student temperature 0.7, teacher tt: NeMo RL's formula
    (its teacher divides its logits by teacher.generation.temperature before its top-k)."""
    p = torch.exp(logits / 0.7) / torch.exp(logits / 0.7).sum()
    q = p[idx] / p[idx].sum()  # the student renormalised over the teacher's top-k
    scaled = torch.tensor(z, dtype=torch.float64) / tt
    t = torch.exp(scaled) / torch.exp(scaled).sum()
    forward = (t * (t.log() - q.log())).sum()
    reverse = (q * (q.log() - t.log())).sum()
    return 0.3 * forward + 0.7 * reverse


def reference_step(before: dict[str, torch.Tensor], overrides: list[str]) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, weights after one SGD step of lr 1) from the slow reference."""
    cfg = load_config(None, BASE + overrides)
    model, _ = load_policy(cfg.policy.model_copy(update={"precision": "float32"}), cfg.run.seed)
    model.load_state_dict(before)
    model.double().train()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for g in groups(VOCAB):
        for c in g.completions:
            logits = model(input_ids=torch.tensor([list(g.prompt_token_ids) + list(c.token_ids)])).logits[0]
            for t, generated in enumerate(c.generated_mask):
                if generated:
                    total = total + position_kl(logits[len(g.prompt_token_ids) + t - 1],
                                                list(c.teacher.logits[t * K:(t + 1) * K]),
                                                list(c.teacher.token_ids[t * K:(t + 1) * K]),
                                                cfg.teacher.generation.temperature)
                    tokens += 1
    loss = total / tokens
    loss.backward()
    return loss.item(), {n: before[n].double() - p.grad for n, p in model.named_parameters()}


HOT_TEACHER = ["teacher.generation.temperature=1.6"]


@pytest.mark.parametrize("world, extra", [(1, []), (2, []), (1, PACKED), (1, HOT_TEACHER)],
                         ids=["one_rank", "two_ranks", "packed", "teacher_temperature"])
def test_one_step_updates_the_weights_as_sgd_on_the_slow_reference_loss(tmp_path, world, extra):
    out = str(tmp_path / "out.pt")
    run_ranks(world, _train, out, SGD + extra, 1)
    got = torch.load(out)
    loss, expected = reference_step(got["before"], SGD + extra)
    assert got["metrics"][0]["loss"] == pytest.approx(loss, rel=1e-5)
    moved = 0.0
    for name, value in expected.items():
        torch.testing.assert_close(got["state"][name].double(), value, rtol=0, atol=2e-5,
                                   msg=lambda m: f"{name}: {m}")
        moved = max(moved, (value - got["before"][name]).abs().max().item())
    assert moved > 1e-3  # the step moved the weights: the comparison is not of two untouched models


def test_repeated_steps_pull_the_student_towards_a_fixed_teachers_topk(tmp_path):
    out = str(tmp_path / "out.pt")
    run_ranks(1, _train, out, ["policy.optimizer.kwargs.lr=0.01"], 8)
    losses = [m["loss"] for m in torch.load(out)["metrics"]]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses


def _three_updates(rank: int, out: str) -> None:
    """The weights' change after one SGD step of: the KL alone, the KL + 0.5 × the reward term, GRPO alone."""
    info = init_distributed(120)
    deltas, metrics = [], []
    for overrides, grpo in ((SGD, False), (SGD + REWARDED, False), (SGD, True)):
        cfg = load_config(None, (["policy.train_micro_batch_size=3", "policy.generation.temperature=0.7"] if grpo
                                 else BASE) + overrides)
        backend = FSDP2Backend(cfg, info)
        batch = build_batch(groups(VOCAB), pad_id=backend.tokenizer.pad_token_id, teacher_k=K)
        advantages, _ = batch_advantages(batch, cfg.grpo)
        before = {k: v.clone() for k, v in backend.full_state_dict().items()}
        if grpo:
            metrics.append(backend.train_step(batch, advantages))
        else:
            metrics.append(backend.distill_step(batch, advantages if overrides != SGD else None))
        deltas.append({k: v - before[k] for k, v in backend.full_state_dict().items()})
    torch.save({"deltas": deltas, "metrics": metrics}, out)


REWARDED = ["++distillation.env_reward_weight=0.5", "++distillation.num_generations_per_prompt=3"]


def test_an_environment_reward_adds_its_weight_times_grpos_update_to_the_kls(tmp_path):
    """distillation.env_reward_weight: the loss is KL + w × GRPO's, so with SGD the update is the KL's plus w times the
    one GRPO's own (separately tested) step makes on the same batch and advantages."""
    out = str(tmp_path / "out.pt")
    run_ranks(1, _three_updates, out)
    got = torch.load(out)
    kl, both, grpo = got["deltas"]
    for name in kl:
        torch.testing.assert_close(both[name], kl[name] + 0.5 * grpo[name], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    assert max(v.abs().max().item() for v in grpo.values()) > 1e-3  # the reward term moved the weights
    m_kl, m_both, m_grpo = got["metrics"]
    assert m_both["kl_loss"] == pytest.approx(m_kl["loss"], rel=1e-5)
    assert m_both["env_reward/loss"] == pytest.approx(m_grpo["loss"], rel=1e-5, abs=1e-7)
    assert m_both["loss"] == pytest.approx(m_kl["loss"] + 0.5 * m_grpo["loss"], rel=1e-5, abs=1e-7)

"""Packed micro-batches (samples end to end, attention kept inside each sample) give the same
logprobs, loss and gradients as padded ones; so does dynamic batching, and a whole FSDP2 step."""

import pytest
import torch
from trainer_harness import config, run_ranks, step_batch

from services.common.modeling import load_policy
from services.trainer.algorithms import LossInputs, clipped_pg_loss
from services.trainer.algorithms.packing import pack_rows, unpack_values
from services.trainer.backends.forward import Forward
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed
from services.trainer.plan import split_by_tokens

PACKED = ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=40",
          "policy.sequence_packing.logprob_mb_tokens=64"]


def test_pack_then_unpack_places_each_samples_targets_back_in_its_row():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    lengths = torch.tensor([3, 2, 4])
    packed = pack_rows(ids, lengths)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    mask = packed.attention_mask[0, 0]
    assert mask[4, 3] and not mask[3, 2] and not mask[5, 4] and not mask[0, 1]  # causal, never across samples
    values = packed.input_ids[0, 1:].float()  # "prediction" p = the next packed token
    assert unpack_values(values, lengths, 3).tolist() == [[6, 7, 0], [9, 0, 0], [2, 3, 4]]


def loss_and_grads(cfg, packing: bool):
    model, _ = load_policy(cfg.policy, cfg.run.seed)
    policy = cfg.policy.model_copy(update={"sequence_packing": cfg.policy.sequence_packing.model_copy(
        update={"enabled": packing})})
    forward = Forward(policy, 1.0, torch.device("cpu"))
    batch, advantages = step_batch(cfg)
    prev = torch.zeros(batch.targets.shape)
    data = LossInputs(prev_logprobs=prev - 1.0, generation_logprobs=batch.generation_logprobs,
                      advantages=advantages, token_mask=batch.token_mask, sample_mask=batch.sample_mask)
    mask = batch.token_mask * batch.sample_mask[:, None]
    totals = dict(global_valid_tokens=mask.sum().item(), global_valid_seqs=batch.sample_mask.sum().item())
    lengths = batch.attention_mask.sum(1).tolist()
    total = 0.0
    for rows in split_by_tokens(range(len(batch)), lengths, 40):
        curr = forward.logprobs(model, batch, rows)
        loss, _ = clipped_pg_loss(curr, forward.loss_inputs(data, rows, curr.shape[1]), cfg.loss_fn, **totals)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters()}


def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients():
    cfg = config(*PACKED)
    padded_loss, padded = loss_and_grads(cfg, packing=False)
    packed_loss, packed = loss_and_grads(cfg, packing=True)
    assert packed_loss == pytest.approx(padded_loss, abs=1e-6)
    assert max(g.abs().max().item() for g in padded.values()) > 1e-3
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _step(rank: int, out: str, overrides: list[str]) -> None:
    # SGD with lr 1: the update is the gradient itself, so weights compare gradients. (Adam's first step,
    # g / (|g| + eps), turns float-rounding differences of near-zero gradients into visible ones.)
    cfg = config("policy.train_micro_batch_size=4", "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}", *overrides)
    backend = FSDP2Backend(cfg, init_distributed(120))
    metrics = backend.train_step(*step_batch(cfg))
    state = backend.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "metrics": metrics}, out)


@pytest.mark.parametrize("mode", [PACKED, ["policy.dynamic_batching.enabled=true",
                                           "policy.dynamic_batching.train_mb_tokens=40"]], ids=["packing", "dynamic"])
def test_a_packed_or_dynamically_batched_fsdp2_step_updates_weights_as_the_padded_one(tmp_path, mode):
    plain, other = str(tmp_path / "plain.pt"), str(tmp_path / "other.pt")
    run_ranks(2, _step, plain, [])
    run_ranks(2, _step, other, mode)
    a, b = torch.load(plain), torch.load(other)
    assert b["metrics"]["loss"] == pytest.approx(a["metrics"]["loss"], abs=1e-6)
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")

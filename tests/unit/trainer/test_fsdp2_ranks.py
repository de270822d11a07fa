"""FSDP2 over 2 gloo ranks updates the weights exactly as 1 rank does on the same step's batch.

The batch has 16 rows of uneven lengths; micro-batches of 3 rows and 2 optimizer steps
per trainer step (train_global_batch_size 8) leave the ranks with different row counts, so
the test also covers the empty micro-batches that keep FSDP's collectives in lockstep.
"""

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from trainer_harness import config, run_ranks, step_batch

from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

OVERRIDES = ["policy.train_micro_batch_size=3", "policy.train_global_batch_size=8", "policy.logprob_batch_size=5",
             "loss_fn.reference_policy_kl_penalty=0.05"]


def _train_once(rank: int, out: str, overrides: list[str]) -> None:
    cfg = config(*overrides)
    backend = FSDP2Backend(cfg, init_distributed(120))
    batch, advantages = step_batch(cfg)
    metrics = backend.train_step(batch, advantages)
    state = backend.full_state_dict()
    if rank == 0:
        mlp = backend.model.model.layers[0].mlp
        gate = mlp.gate_proj.weight if hasattr(mlp, "gate_proj") else mlp.experts.gate_up_proj  # MoE: [experts, ...]
        layer = backend.model.model.layers[0]
        adapters = {f"{m}.{ab}": getattr(getattr(layer.self_attn, m), ab).weight for m in ("q_proj", "o_proj")
                    for ab in ("lora_A", "lora_B") if hasattr(getattr(layer.self_attn, m), ab)}
        torch.save({"state": state, "metrics": metrics, "offloaded": _offloaded(backend.model),
                    "adapter_tp": {k: [str(p) for p in w.placements][-1] for k, w in adapters.items()
                                   if hasattr(w, "placements")},
                    "gate_local_rows": gate.to_local().shape[0] if hasattr(gate, "to_local") else gate.shape[0],
                    "gate_rows": gate.shape[0]}, out)


def _offloaded(model: torch.nn.Module) -> bool | None:
    """Whether FSDP2 holds the root's shards under CPUOffloadPolicy; None for one CPU rank's plain module."""
    state = getattr(model, "_get_fsdp_state", None)
    return None if state is None else isinstance(state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)


@pytest.mark.parametrize("extra", [[], ["policy.activation_checkpointing=true"], ["policy.cpu_offload=true"],
                                   # SGD at lr 1: weights compare gradients (Adam's g / (|g| + eps) magnifies
                                   # the rounding of TP's other reduction order in near-zero gradients)
                                   ["policy.tensor_parallel_size=2", "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}"],
                                   # Qwen3's per-head q_norm/k_norm: whole on each TP rank, gradients summed over TP
                                   ["policy.tensor_parallel_size=2", "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}",
                                    "policy.tiny.architecture=qwen3"],
                                   ["policy.lora_cfg.enabled=true", "policy.activation_checkpointing=true"],
                                   # adapters on every linear layer (lm_head too) split with their base layers
                                   ["policy.tensor_parallel_size=2", "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}",
                                    "policy.lora_cfg.enabled=true", "policy.lora_cfg.match_all_linear=true"],
                                   # masks some of the batch's samples; SGD as for tp2 (an embedding row's gradient
                                   # that the masked samples leave near zero is rounding, which Adam magnifies)
                                   ["grpo.seq_logprob_error_threshold=20", "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}"],
                                   # Qwen3-MoE: the experts' fused tensors sharded over their first (expert) dim;
                                   # SGD as for tp2 (3 of an expert's 65,536 weights differed by 3e-5 under Adam)
                                   ["policy.tiny.architecture=qwen3_moe", "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}"]],
                         ids=["plain", "act_ckpt", "cpu_offload", "tp2", "tp2_qwen3", "lora", "tp2_lora", "seq_mask",
                              "moe"])
def test_two_gloo_ranks_give_the_same_updated_weights_as_one_rank(tmp_path, extra):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run_ranks(1, _train_once, one, OVERRIDES + [e for e in extra if "tensor_parallel" not in e])  # TP needs 2
    run_ranks(2, _train_once, two, OVERRIDES + extra)
    a, b = torch.load(one), torch.load(two)
    assert (a["offloaded"], b["offloaded"]) == (None, "policy.cpu_offload=true" in extra)
    # each rank holds half the rows: FSDP's dp shard, or with TP (dp = 1) the gate projection's column split
    assert b["gate_local_rows"] * 2 == b["gate_rows"] == a["gate_local_rows"]
    if "policy.tensor_parallel_size=2" in extra and "policy.lora_cfg.enabled=true" in extra:
        # colwise q_proj: A whole, B split by rows like W; rowwise o_proj: A split by columns like W, B whole
        assert b["adapter_tp"] == {"q_proj.lora_A": "R", "q_proj.lora_B": "S(0)", "o_proj.lora_A": "S(1)",
                                   "o_proj.lora_B": "R"}
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for name in ("loss", "probs_ratio_min", "probs_ratio_max", "grad_norm", "lr", "kl_penalty",
                 *[m for m in ("num_masked_seqs_by_logprob_error", "max_seq_mult_prob_error_after_mask") if m in a["metrics"]]):
        assert b["metrics"][name] == pytest.approx(a["metrics"][name], rel=1e-4, abs=1e-6), name


def _initial(rank: int, out: str) -> None:
    cfg = config(*OVERRIDES)
    backend = FSDP2Backend(cfg, init_distributed(120))
    if rank == 0:
        torch.save(backend.full_state_dict(), out)


def test_one_step_changes_the_weights(tmp_path):
    """Guards the test above: equal weights must not come from a step that did nothing."""
    before, after = str(tmp_path / "before.pt"), str(tmp_path / "after.pt")
    run_ranks(1, _initial, before)
    run_ranks(1, _train_once, after, OVERRIDES)
    a, b = torch.load(before), torch.load(after)["state"]
    moved = max((a[n] - b[n]).abs().max().item() for n in a)
    assert moved > 1e-3


def test_logprob_chunks_give_the_same_step(tmp_path):
    """policy.logprob_chunk_size bounds memory only: the step's weights and metrics are those of the whole rows."""
    whole, chunked = str(tmp_path / "whole.pt"), str(tmp_path / "chunked.pt")
    run_ranks(1, _train_once, whole, OVERRIDES)
    run_ranks(1, _train_once, chunked, [*OVERRIDES, "policy.logprob_chunk_size=3"])
    a, b = torch.load(whole), torch.load(chunked)
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name in ("loss", "grad_norm", "kl_penalty"):
        assert b["metrics"][name] == pytest.approx(a["metrics"][name], rel=1e-5, abs=1e-7), name

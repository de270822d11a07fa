"""FSDP2 context parallelism (policy.context_parallel_size; services/trainer/backends/context_parallel.py).

The oracle is the same trainer without it, on as many gloo ranks: two GRPO steps of two optimizer steps each (prev
logprobs recomputed) with SGD (a gradient off by any factor shows in the weights) and a KL term (the reference
split the same way), once with each row's positions split over CP groups of two ranks, once with the rows spread
over all ranks. The weights, the step metrics and the published state must agree, and the split must be real: each
rank's model saw only half of each row's positions.
"""

from pathlib import Path

import pytest
import torch
from trainer_harness import assert_trained_alike, config, run_ranks, step_batch

from services.common.config import ConfigError, load_config
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

ROOT = Path(__file__).resolve().parents[3]
RUN = ["policy.optimizer={name: SGD, kwargs: {lr: 0.1}}", "loss_fn.reference_policy_kl_penalty=0.05",
       "policy.train_global_batch_size=8", "policy.train_micro_batch_size=4"]


def _train(rank: int, out: str, cp: int) -> None:
    cfg = config(*RUN, f"policy.context_parallel_size={cp}")
    backend = FSDP2Backend(cfg, init_distributed(120))
    widths: list[tuple[int, int]] = []  # (positions this rank's model ran, the rows' width)
    batch, advantages = step_batch(cfg)
    backend.model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                            with_kwargs=True)
    metrics = [backend.train_step(batch, advantages) for _ in range(2)]
    state = backend.full_state_dict()
    if rank == 0:
        torch.save({"state": state, "metrics": metrics, "widths": widths,
                    "full": int(batch.attention_mask.sum(1).max())}, out)


@pytest.mark.parametrize("world", [2, 4])  # 4: two CP groups, the rows split between them
def test_rows_split_over_context_parallel_ranks_train_as_fsdp2_alone_does(tmp_path, world):
    split, whole = str(tmp_path / "cp2.pt"), str(tmp_path / "cp1.pt")
    run_ranks(world, _train, split, 2)
    run_ranks(world, _train, whole, 1)
    a, b = torch.load(split), torch.load(whole)
    assert max(a["widths"]) <= -(-a["full"] // 2) < max(b["widths"]), (a["widths"], b["widths"], a["full"])
    assert_trained_alike(a, b, atol=2e-6,
                         metrics=("loss", "grad_norm", "kl_penalty", "probs_ratio_max", "token_mult_prob_error"))


@pytest.mark.parametrize("overrides", [
    ["policy.context_parallel_size=2", "policy.tensor_parallel_size=2"],
    ["policy.context_parallel_size=2", "policy.sequence_packing.enabled=true"],
    ["policy.context_parallel_size=2", "policy.megatron_cfg.enabled=true"]])
def test_context_parallelism_with_what_it_is_not_built_with_is_refused(overrides):
    with pytest.raises(ConfigError, match="context_parallel_size > 1 is the FSDP2 backend's"):
        load_config(None, overrides)


def test_distillation_under_context_parallelism_is_refused():
    """Distillation's loss takes the whole vocabulary's logits, which a CP rank holds only for its own positions."""
    distillation = ROOT / "tests/fixtures/nemo_rl/examples/configs/distillation_math.yaml"
    with pytest.raises(ConfigError, match="distillation's whole-vocabulary logits .* not built"):
        load_config(distillation, ["policy.generation.colocated.enabled=false", "policy.sequence_packing.enabled=false",
                                   "policy.dtensor_cfg.tensor_parallel_size=1"])

"""The offline step (SFT, DPO) on 2 gloo ranks updates the weights exactly as on 1 rank.

SFT's loss is normalized by the step's valid tokens and DPO's by its valid rows, counted over the whole batch,
so splitting rows over ranks and micro-batches (uneven: some micro-batches are empty on one rank) must not change
the update. DPO keeps each (chosen, rejected) pair in one micro-batch and takes the reference's logprobs first.
"""

import pytest
import torch
from trainer_harness import groups, run_ranks

from services.common.config import load_config
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.batch import build_batch
from services.trainer.distributed import init_distributed

COMMON = ["~environments", "++data.train.data_path=unused.jsonl", "policy.train_micro_batch_size=3",
          "policy.optimizer={name: SGD, kwargs: {lr: 1.0}}"]
CASES = {"sft": (["++sft.max_num_steps=1"], dict(n_groups=13, size=1)),
         "dpo": (["++dpo.max_num_steps=1", "++dpo.reference_policy_kl_penalty=0.5", "++dpo.sft_loss_weight=0.3"],
                 dict(n_groups=7, size=2))}


def _step(rank: int, out: str, algorithm: str) -> None:
    overrides, shape = CASES[algorithm]
    cfg = load_config(None, COMMON + overrides)
    backend = FSDP2Backend(cfg, init_distributed(120))
    batch = build_batch(groups(**shape), pad_id=0)
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}  # one CPU rank hands out views
    metrics = backend.offline_step(batch)
    state = backend.full_state_dict()
    if rank == 0:
        torch.save({"before": before, "state": state, "metrics": metrics}, out)


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_two_gloo_ranks_give_the_same_offline_step_as_one(tmp_path, algorithm):
    one, two = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    run_ranks(1, _step, one, algorithm)
    run_ranks(2, _step, two, algorithm)
    a, b = torch.load(one), torch.load(two)
    assert max((a["before"][n] - a["state"][n]).abs().max().item() for n in a["state"]) > 1e-3  # it did step
    for name, value in a["state"].items():
        torch.testing.assert_close(b["state"][name], value, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    names = ["loss", "grad_norm"] + (["accuracy", "preference_loss", "sft_loss", "rewards_chosen_mean"]
                                     if algorithm == "dpo" else ["num_unmasked_tokens"])
    for name in names:
        assert b["metrics"][name] == pytest.approx(a["metrics"][name], rel=1e-4, abs=1e-6), name

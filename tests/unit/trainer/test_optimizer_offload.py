"""policy.offload_optimizer_for_logprob, and gradients freed when their step is done.

Where the optimizer's state actually leaves the GPU and comes back is checked on a GPU (tests/gpu/test_fsdp2_gpu.py:
the state on the host during the reference forward, back on cuda for the step, and the memory it frees). On CPU
there is nothing to move; what is checked here is that the flag changes no arithmetic, for GRPO and DPO, and that
no gradient outlives the optimizer step it served.
"""

import pytest
import torch
from trainer_harness import config, run_ranks, step_batch

from services.common.config import ConfigError, load_config
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed

# Two optimizer steps per batch (prev logprobs recomputed), a KL term (reference logprobs): both logprob forwards.
OVERRIDES = ["policy.train_global_batch_size=8", "loss_fn.reference_policy_kl_penalty=0.05"]


def _train(rank: int, out: str, offload: bool) -> None:
    cfg = config(*OVERRIDES, f"policy.offload_optimizer_for_logprob={str(offload).lower()}")
    backend = FSDP2Backend(cfg, init_distributed(120))
    batch, advantages = step_batch(cfg)
    metrics = [backend.train_step(batch, advantages) for _ in range(2)]  # the second with the state built
    grads = [n for n, p in backend.model.named_parameters() if p.grad is not None]
    torch.save({"state": backend.full_state_dict(), "metrics": metrics, "grads": grads}, out)


def test_offloading_the_optimizer_for_the_logprob_forwards_changes_no_update_and_frees_every_gradient(tmp_path):
    on, off = str(tmp_path / "on.pt"), str(tmp_path / "off.pt")
    run_ranks(1, _train, on, True)
    run_ranks(1, _train, off, False)
    a, b = torch.load(on), torch.load(off)
    assert a["grads"] == [] == b["grads"], "a gradient outlived its optimizer step"
    for name, value in b["state"].items():
        assert torch.equal(a["state"][name], value), name
    untimed = [[{k: v for k, v in m.items() if not k.startswith("timing/")} for m in x["metrics"]] for x in (a, b)]
    assert untimed[0] == untimed[1]


def test_offloading_the_optimizer_is_the_fsdp2_trainers():
    with pytest.raises(ConfigError, match="offload_optimizer_for_logprob is the FSDP2 backend's"):
        load_config(None, ["policy.megatron_cfg.enabled=true", "policy.offload_optimizer_for_logprob=true"])

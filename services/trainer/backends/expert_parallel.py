"""FSDP2's expert parallelism: each mixture-of-experts layer's experts split over an EP mesh by the model's own
Hugging Face plan (`config.base_model_ep_plan`, transformers' `apply_expert_parallelism`).

    ranks (world W, EP size E):   expert mesh (efsdp = W / E, ep = E), EP groups of consecutive ranks
    ep:     the experts of a layer, Shard(0) over an EP group; each token goes to its experts' ranks by all-to-all
            and comes back the same way (gloo runs it, so CPU tests the path)
    efsdp:  the ranks across EP groups that hold the same experts, which FSDP2 shards them over

Dense parameters stay on the data-parallel mesh. Gradient scale: the trainer multiplies each rank's loss by the
data-parallel size D and lets FSDP2 average, so a dense gradient is the sum over every rank's rows. An expert's
gradient already gathers, through the all-to-all's backward, the rows of its whole EP group; FSDP2 sums it over
efsdp and divides by D (not by efsdp's size), so it too is the sum over every rank's rows, as transformers' own
FSDP plan does. gloo has no scaling reduce-scatter, so the sum and the division run apart there.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

DISPATCH = "ep_dispatch_experts"
"""The plan style of a module whose experts take dispatched tokens (what EP needs)."""

PLANS = {"nemotron_h": {"model.layers.*.mixer.experts.up_proj": "grouped_gemm",
                        "model.layers.*.mixer.experts.down_proj": "grouped_gemm",
                        "model.layers.*.mixer.experts": DISPATCH}}
"""Plans transformers (5.19) lacks, for model types NeMo RL's expert-parallel recipes train: Nemotron-H's experts are
transformers' standard experts module (3D up/down projections, called with the tokens' top-k experts and weights),
so the same dispatch applies; tests/unit/trainer/test_expert_parallel.py checks it against FSDP2 alone."""


def shard_experts(model: nn.Module, expert_mesh: DeviceMesh, tp_mesh: DeviceMesh, data_parallel: int,
                  **fsdp_kwargs) -> list[nn.Module]:
    """Split `model`'s experts over expert_mesh["ep"] and fully_shard each experts module over expert_mesh["efsdp"];
    returns those modules. Call before the decoder layers are sharded, so their FSDP2 groups leave the experts out."""
    from transformers.distributed.tensor_parallel import apply_expert_parallelism

    plan = dict(getattr(model, "ep_plan", None) or PLANS.get(model.config.model_type, {}))
    if DISPATCH not in plan.values():
        raise ValueError(f"policy.expert_parallel_size {expert_mesh['ep'].size()}: transformers has no expert-parallel "
                         f"plan with token dispatch for {model.config.model_type}")
    apply_expert_parallelism(model, expert_mesh["ep"], tp_mesh, plan)
    experts = [m for m in model.modules() if any(isinstance(p, DTensor) for p in m.parameters(recurse=False))]
    for module in experts:
        fully_shard(module, mesh=expert_mesh["efsdp"], **fsdp_kwargs)
        module.set_gradient_divide_factor(float(data_parallel))
        if expert_mesh["efsdp"].size() > 1 and dist.get_backend(expert_mesh["efsdp"].get_group()) != "nccl":
            # gloo cannot scale inside its reduce-scatter. Only where one runs: over a single rank torch (2.13)
            # copies the gradient divided by the factor and, with this set, divides it again.
            module.set_force_sum_reduction_for_comms(True)
    return experts

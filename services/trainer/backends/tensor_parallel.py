"""FSDP2's tensor parallelism: the model split over a TP mesh by its own Hugging Face plan.

Hugging Face models describe their TP layout in `config.base_model_tp_plan` (module pattern -> style). The
dense decoders' plans use three styles, all applied here: colwise and rowwise split the linear layers
(torch's ColwiseParallel/RowwiseParallel), and replicated_with_grad_allreduce marks the layers every rank holds
whole but applies to its own heads only (Qwen3's q_norm/k_norm), whose gradients the step sums over TP.

A LoRA layer (services/trainer/lora.py) is split with its base: colwise, A stays whole and B is split by output
rows like W, so B A x comes out split as W x does; rowwise, A is split by input columns like W and B stays whole,
so B A x comes out as a partial sum that the layer's all-reduce completes with W x's.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Colwise(ColwiseParallel):
    """torch's ColwiseParallel, and a LoRA layer's adapters with it: lora_A whole, lora_B split like W.
    (torch's own registers every parameter of the subtree under the layer, dotted names included, which fails.)"""

    def _partition_linear_fn(self, name, module, device_mesh):
        placement = Replicate() if name == "lora_A" else Shard(0)  # name: the submodule's, "" for the layer
        for key, param in module.named_parameters(recurse=False):
            module.register_parameter(key, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))


class Rowwise(RowwiseParallel):
    """torch's RowwiseParallel, and a LoRA layer's adapters with it: lora_A split like W, lora_B whole (what the
    module leaves unsplit, distribute_module replicates)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        if name != "lora_B":
            super()._partition_linear_fn(name, module, device_mesh)


TP_STYLES = {"colwise": Colwise, "rowwise": Rowwise}
"""The Hugging Face plan styles Flywheel applies (dense decoders); MoE and packed styles are refused."""
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """Split the model over the TP `mesh` by its own Hugging Face plan (`config.base_model_tp_plan`: attention
    q/k/v and MLP gate/up by output columns, o/down by input rows, so each block needs one all-reduce), and
    lm_head by output columns, gathered back whole for the log-softmax. Embeddings and norms stay whole.
    A tied lm_head stays whole too: splitting it would split the embedding it shares.

    Layers the plan marks `replicated_with_grad_allreduce` (Qwen3's per-head q_norm/k_norm) stay whole; see
    `grad_allreduce_params`."""
    plan = {key: style for key, style in _tp_plan(model).items() if style != GRAD_ALLREDUCE}
    odd = sorted({style for style in plan.values()} - set(TP_STYLES))
    if not plan or odd:
        raise ValueError(f"{type(model).__name__}: policy.tensor_parallel_size > 1 needs a Hugging Face TP plan of "
                         f"{' and '.join(TP_STYLES)} layers; this model's is {plan or 'missing'}")
    size, c = mesh.size(), model.config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(c, name, None) or c.num_attention_heads
        if heads % size:
            raise ValueError(f"{name} {heads} is not divisible by policy.tensor_parallel_size {size}")
    parallelize_module(model.base_model, mesh, {key: TP_STYLES[style]() for key, style in plan.items()})
    if not getattr(c, "tie_word_embeddings", False):
        parallelize_module(model, mesh, {"lm_head": Colwise(output_layouts=Replicate())})


def _tp_plan(model: torch.nn.Module) -> dict[str, str]:
    return dict(getattr(model.config, "base_model_tp_plan", None) or {})


def grad_allreduce_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of the layers the TP plan marks `replicated_with_grad_allreduce`: whole on every
    rank but applied to that rank's heads only, so each rank's gradient is a part and the step needs their sum
    over the TP group (`sum_over_tp`)."""
    keys = [key for key, style in _tp_plan(model).items() if style == GRAD_ALLREDUCE]
    return [p for name, p in model.base_model.named_parameters()
            if p.requires_grad and any(fnmatch.fnmatchcase(name.rpartition(".")[0], key) for key in keys)]



def sum_over_tp(params: list[torch.nn.Parameter], mesh) -> None:
    """Each parameter's gradient summed over the TP group, in place. Under FSDP2 a gradient is this rank's dp
    shard (a DTensor on the dp mesh), the same slice on every rank of a TP group, so its local part is summed."""
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=mesh.get_group())

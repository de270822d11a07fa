"""FSDP2's context parallelism: each row's positions split over a CP group, attention over the whole row.

    CP group of n consecutive ranks, the same rows; rank c holds positions [c*k, (c+1)*k) of each (k = width / n,
    the width padded to a multiple of n)
    each attention layer:  q of my positions; k, v all-gathered from the group -> the whole row's keys
                           causal over global positions (a row is right-padded, so causality alone keeps padding out)
    logprobs:              my positions' logprobs, all-gathered -> the whole row's, on every rank of the group

The loss is then the same on every rank of the group, as a TP group's is, so the step's metrics need nothing new.
Gradients: the logprobs' all-gather sums the group's n identical loss gradients back onto each chunk (n times the
true one), and FSDP2, sharding over all ranks, averages over n times as many ranks as the trainer's loss multiplier
(the data-parallel size) counts: the two cancel, and each parameter's gradient is the sum over every rank's rows.
The keys' and values' all-gather sends each position's key gradient back to the rank that made it. All-gather
rather than ring attention: torch's ring attention runs only on CUDA's flash and efficient kernels, so CPU could not
test it; this path holds a whole row's keys and values per layer, and the logits only for its own positions.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed._functional_collectives import all_gather_single_autograd

ATTENTION = "flywheel_context_parallel"
"""The attention implementation's name in transformers' AttentionInterface."""


def use_context_parallel_attention(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Make `model`'s attention layers attend over the whole row, gathering keys and values from `group`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, functools.partial(attention, group=group))
    model.set_attn_implementation(ATTENTION)


def gather_positions(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """The group's chunks of `x` along `dim`, in rank order; differentiable (each chunk's gradient is summed
    over the ranks that used it and returned to its owner). torch's older torch.distributed.nn all_gather is not
    used: on gloo its backward names subgroup ranks as global ones, and fails for every CP group but the first."""
    return all_gather_single_autograd(x.contiguous(), gather_dim=dim, group=group)


def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
              softcap: float | None = None, *, group: dist.ProcessGroup, **_) -> tuple[Tensor, None]:
    """transformers' attention signature: query [B, H, k, D] of this rank's positions, key and value
    [B, Hkv, k, D]; returns [B, k, H, D]. Causal over global positions (and within `sliding_window` when the
    layer has one). attention_mask is None: no mask is built for this implementation, and rows are right-padded."""
    if softcap is not None:
        raise ValueError("context parallelism: attention logit softcapping is not built")
    k = query.shape[2]
    q_pos = torch.arange(k, device=query.device) + dist.get_rank(group) * k
    k_pos = torch.arange(k * dist.get_world_size(group), device=query.device)
    out = attend_over_row(query, key, value, q_pos, k_pos, group, scale=scaling, sliding_window=sliding_window,
                          dropout=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def attend_over_row(query: Tensor, key: Tensor, value: Tensor, q_pos: Tensor, k_pos: Tensor,
                    group: dist.ProcessGroup, scale: float | None = None, sliding_window: int | None = None,
                    dropout: float = 0.0) -> Tensor:
    """Queries [B, H, q, D] at global positions `q_pos` against the whole row's keys and values: this rank's
    [B, Hkv, k, D] gathered over `group`, the gathered positions (in rank order) being `k_pos`. Causal over global
    positions, and within `sliding_window` when given; returns [B, H, q, D]. Both backends' context parallelism
    attend through it, each with its own layout of positions over ranks."""
    # One collective for both: two would have to run in the same order on every rank in backward too.
    key, value = gather_positions(torch.cat([key, value], dim=-1), group, 2).split(key.shape[-1], dim=-1)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scale,
                                          enable_gqa=key.shape[1] != query.shape[1])


def chunk_of(ids: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    """(this rank's input ids [B, k], their global positions [B, k], their targets [B, k]) of right-padded `ids`
    [B, W]; W is padded with 0 to n * k, and the last position's target is padding."""
    n, c = dist.get_world_size(group), dist.get_rank(group)
    k = -(-ids.shape[1] // n)
    padded = F.pad(ids, (0, n * k + 1 - ids.shape[1]))
    span = slice(c * k, (c + 1) * k)
    positions = torch.arange(c * k, (c + 1) * k).expand(ids.shape[0], -1)
    return padded[:, span], positions, padded[:, c * k + 1:(c + 1) * k + 1]

"""The step gradient does not depend on how the step is cut into micro-batches or ranks.

clipped_pg_loss divides by the step's global valid token/sequence counts, so summing
micro-batch gradients (accumulation) and SUM-all-reducing them across data-parallel ranks
must reproduce the full-batch gradient of a tiny embedding + linear "LM".
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.common.config import LossConfig
from services.trainer.algorithms import LossInputs, clipped_pg_loss

BATCH, LENGTH, VOCAB, HIDDEN = 8, 6, 11, 8

CONFIGS = {
    "token_level_tis_kl": dict(reference_policy_kl_penalty=0.05, truncated_importance_sampling_type="tis",
                               truncated_importance_sampling_ratio=1.5),
    "sequence_level_icepop": dict(token_level_loss=False, truncated_importance_sampling_type="icepop",
                                  truncated_importance_sampling_ratio=1.5,
                                  truncated_importance_sampling_ratio_min=0.7),
    "gspo": dict(token_level_loss=False, sequence_level_importance_ratios=True, ratio_clip_c=3.0),
}


def tiny_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)).double()


def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] logprob of tokens[:, 1:] given tokens[:, :-1] (a bigram model is enough here)."""
    logits = model(tokens[:, :-1])
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def step_batch() -> tuple[torch.Tensor, LossInputs]:
    """One optimizer step's rows, identical in every process."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g)
    with torch.no_grad():
        prev = token_logprobs(tiny_lm(), tokens)
    token_mask = torch.rand(BATCH, LENGTH, generator=g) < 0.7
    token_mask[2] = False
    sample_mask = torch.ones(BATCH, dtype=torch.bool)
    sample_mask[5] = False
    data = LossInputs(
        prev_logprobs=prev,
        generation_logprobs=prev + 0.2 * torch.randn(BATCH, LENGTH, generator=g, dtype=torch.float64),
        reference_logprobs=prev + 0.3 * torch.randn(BATCH, LENGTH, generator=g, dtype=torch.float64),
        advantages=torch.randn(BATCH, generator=g, dtype=torch.float64),
        token_mask=token_mask,
        sample_mask=sample_mask,
    )
    return tokens, data


def rows(data: LossInputs, index: slice) -> LossInputs:
    return LossInputs(**{name: getattr(data, name)[index] for name in LossInputs.__slots__})


def local_counts(data: LossInputs) -> torch.Tensor:
    """[valid tokens, valid sequences] of these rows, as NeMo RL counts them before its all-reduce."""
    tokens = (data.token_mask & data.sample_mask[:, None]).sum()
    return torch.stack([tokens, data.sample_mask.sum()]).double()


def accumulated_gradient(cfg, tokens, data, micro_batches, counts) -> torch.Tensor:
    """Train-step gradient of the tiny LM: micro-batch losses backpropagated one by one."""
    model = tiny_lm()
    size = tokens.shape[0] // micro_batches
    for start in range(0, tokens.shape[0], size):
        part = slice(start, start + size)
        # Scaled so the current policy differs from prev and some ratios clip.
        curr = token_logprobs(model, tokens[part]) * 1.1
        loss, _ = clipped_pg_loss(curr, rows(data, part), cfg, global_valid_tokens=float(counts[0]),
                                  global_valid_seqs=float(counts[1]))
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradient_is_the_same_for_one_two_or_four_micro_batches(name, micro_batches):
    cfg = LossConfig(**CONFIGS[name])
    tokens, data = step_batch()
    counts = local_counts(data)
    whole = accumulated_gradient(cfg, tokens, data, 1, counts)
    split = accumulated_gradient(cfg, tokens, data, micro_batches, counts)
    assert whole.abs().max() > 1e-3
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-9)


def _data_parallel_rank(rank: int, world: int, store_path: str, names: list[str]) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        for name in names:
            cfg = LossConfig(**CONFIGS[name])
            tokens, data = step_batch()
            shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            counts = local_counts(rows(data, shard))
            dist.all_reduce(counts)  # the step's global counts, summed over ranks
            grad = accumulated_gradient(cfg, tokens[shard], rows(data, shard), 2, counts)
            dist.all_reduce(grad)  # SUM: each loss is already divided by the global counts
            single = accumulated_gradient(cfg, tokens, data, 1, local_counts(data))
            torch.testing.assert_close(grad, single, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
    finally:
        dist.destroy_process_group()


def test_gradient_summed_over_two_gloo_ranks_equals_single_process_gradient(tmp_path):
    names = ["token_level_tis_kl", "gspo"]
    mp.spawn(_data_parallel_rank, args=(2, str(tmp_path / "store"), names), nprocs=2, join=True)

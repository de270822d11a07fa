"""Megatron-Core's context parallelism without Transformer Engine (megatron_context_parallel.py), on 2 gloo ranks:
the attention of each rank's positions, in megatron's load-balanced layout, against attention over the whole row
(values and the gradients of queries, keys and values); the logprobs put back in row order; the GPTModel the
backend builds at context_parallel_size 2 attends with it and holds every HF weight. megatron-core's forward around it needs CUDA (tests/gpu/)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from needs import require_module
from trainer_harness import run_ranks

require_module("megatron.core")
from megatron.core import parallel_state  # noqa: E402

from services.common.config import load_config  # noqa: E402
from services.common.modeling import load_policy  # noqa: E402
from services.trainer.backends.hf_megatron import Shape  # noqa: E402
from services.trainer.backends.megatron import padded_width  # noqa: E402
from services.trainer.backends.megatron_context_parallel import whole_row, zigzag_positions  # noqa: E402
from services.trainer.backends.megatron_model import build_gpt, gather_hf  # noqa: E402

W, B, HEADS, GROUPS, D = 16, 2, 4, 2, 8


def test_each_rank_holds_two_chunks_mirrored_and_together_they_hold_the_row_once():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]  # megatron's get_pos_emb_on_this_cp_rank's chunks
    held = torch.cat([zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        zigzag_positions(10, 2, 0)


def test_rows_are_padded_to_what_context_and_sequence_parallelism_split_evenly():
    assert padded_width(13, tp=1, cp=1) == 13
    assert padded_width(13, tp=2, cp=1) == 14
    assert padded_width(13, tp=1, cp=2) == 16
    assert padded_width(13, tp=2, cp=2) == 16 and padded_width(17, tp=2, cp=2) == 24


def _ranks(rank: int, out: str) -> None:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from services.trainer.backends.megatron_context_parallel import ContextParallelAttention

    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, context_parallel_size=2, attention_dropout=0.0,
                               use_cpu_initialization=True)
    attention = ContextParallelAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)  # the same row on both ranks
    q, k, v = torch.randn(W, B, HEADS, D), torch.randn(W, B, GROUPS, D), torch.randn(W, B, GROUPS, D)
    weights = torch.randn(W, B, HEADS * D)
    mine = zigzag_positions(W, 2, rank)
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    got = attention(*local, None)
    (got * weights[mine]).sum().backward()  # the two ranks' losses add up to the whole row's
    row = torch.arange(B * W, dtype=torch.float32).reshape(B, W)
    part = row[:, mine].clone().requires_grad_()
    whole = whole_row(part, group)
    whole.sum().backward()
    hf = hf_model()
    _, gpt = build_gpt(hf, policy(), cpu=True)
    result = dict(positions=mine, out=got.detach(), grads=[t.grad for t in local], whole=whole.detach(),
                  whole_grad=part.grad, back=gather_hf(gpt, Shape.of(hf.config, False)),
                  attention={type(m.self_attention.core_attention).__name__ for m in gpt.decoder.layers})
    with pytest.raises(ValueError, match="attention dropout are not built"):
        build_gpt(hf_model("policy.hf_config_overrides.attention_dropout=0.1"), policy(), cpu=True)
    results = [None, None]
    dist.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)


def policy(*overrides: str):
    return load_config(None, ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.context_parallel_size=2",
                              *overrides]).policy


def hf_model(*overrides: str):
    torch.manual_seed(1)
    model, _ = load_policy(policy(*overrides).model_copy(update={"precision": "float32"}), seed=0)
    for t in model.parameters():  # norms start at 1: make every tensor distinct
        torch.nn.init.normal_(t)
    return model


def test_two_ranks_attend_as_attention_over_the_whole_row_and_get_the_same_gradients(tmp_path):
    run_ranks(2, _ranks, str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt")
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in (torch.randn(W, B, HEADS, D), torch.randn(W, B, GROUPS, D),
                                            torch.randn(W, B, GROUPS, D)))
    weights = torch.randn(W, B, HEADS * D)
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=True).permute(2, 0, 1, 3).reshape(W, B, -1)
    (ref * weights).sum().backward()
    for r in results:
        mine = r["positions"]
        torch.testing.assert_close(r["out"], ref.detach()[mine], rtol=0, atol=1e-5)
        for got, want in zip(r["grads"], (q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(got, want[mine], rtol=0, atol=1e-5)
        row = torch.arange(B * W, dtype=torch.float32).reshape(B, W)
        assert torch.equal(r["whole"], row)
        # each rank's identical loss sends its gradient back to every rank's positions: 2x (megatron.py divides)
        assert torch.equal(r["whole_grad"], torch.full((B, W // 2), 2.0))
        # the GPTModel the backend builds attends this way, and holds every HF weight on both ranks
        assert r["attention"] == {"ContextParallelAttention"}
        assert all(torch.equal(r["back"][n], t) for n, t in hf_model().state_dict().items())

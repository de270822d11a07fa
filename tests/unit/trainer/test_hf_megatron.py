"""HF <-> Megatron-Core weight conversion: bit for bit both ways, the grouped QKV layout against a
slow per-head reference, Qwen3-MoE experts against a per-expert reference, tensor/pipeline/expert shards,
the rollout's manifest (names, order, tied lm_head) of the same HF model (a real GPTModel's:
test_megatron_build.py)."""

import os

import pytest
import torch
from needs import require_module
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from services.common.infra import free_port
from services.common.weights.manifest import Manifest
from services.rollout.engines.vllm import hf_manifest
from services.trainer.backends.hf_megatron import (Shape, ep_merge, ep_split, hf_to_megatron, is_expert,
                                                   megatron_to_hf, pp_merge, pp_split, stage_layers, tp_merge,
                                                   tp_split)

ARCH = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])


def hf_model(arch: str, tied: bool = False, vocab_size: int = 48, **moe):
    extra = MOE | moe if arch == "qwen3_moe" else {}
    config = ARCH[arch](vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
                        **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for p in model.parameters():  # norms start at 1 and biases at 0: make every tensor distinct
        torch.nn.init.normal_(p)
    return model


@pytest.mark.parametrize("fused", [True, False], ids=["te_spec", "local_spec"])
@pytest.mark.parametrize("arch", sorted(ARCH))
def test_hf_to_megatron_and_back_is_bit_for_bit(arch, fused):
    model = hf_model(arch)
    hf = model.state_dict()
    shape = Shape.of(model.config, fused_norms=fused)
    mc = hf_to_megatron(hf, shape)
    if shape.num_experts:  # one linear_fc1 and one linear_fc2 per expert and layer
        assert sum(is_expert(n) for n in mc) == 2 * shape.num_experts * shape.num_layers
    else:
        assert len(mc) < len(hf)  # q, k, v fused; gate, up fused
    back = megatron_to_hf(mc, shape)
    assert list(back) == list(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    again = hf_to_megatron(back, shape)
    assert all(torch.equal(again[n], t) for n, t in mc.items())


def reference_qkv(q, k, v, heads, groups, d):
    """Row by row: for each group g, its query heads, then key head g, then value head g."""
    rows = []
    per = heads // groups
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows += [q[h * d + j] for j in range(d)]
        rows += [k[g * d + j] for j in range(d)]
        rows += [v[g * d + j] for j in range(d)]
    return torch.stack(rows)


def test_qkv_layout_matches_the_per_head_reference():
    model = hf_model("qwen2")
    hf, shape = model.state_dict(), Shape.of(model.config)
    mc = hf_to_megatron(hf, shape)
    a = "model.layers.1.self_attn."
    for kind in ("weight", "bias"):
        expected = reference_qkv(hf[a + f"q_proj.{kind}"], hf[a + f"k_proj.{kind}"], hf[a + f"v_proj.{kind}"],
                                 shape.num_heads, shape.num_kv_heads, shape.head_dim)
        assert torch.equal(mc[f"decoder.layers.1.self_attention.linear_qkv.{kind}"], expected)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(mc["decoder.layers.1.mlp.linear_fc1.weight"][: gate.shape[0]], gate)
    assert torch.equal(mc["decoder.layers.1.mlp.linear_fc1.weight"][gate.shape[0]:], up)


def test_moe_experts_match_the_per_expert_reference():
    """Expert e's linear_fc1 is [gate_e; up_e] row by row, linear_fc2 its down_proj; Megatron's SwiGLU over
    them (silu of the first half times the second) is HF's expert forward."""
    model = hf_model("qwen3_moe")
    hf, shape = model.state_dict(), Shape.of(model.config)
    assert shape.num_experts == 4 and shape.qk_norm
    mc = hf_to_megatron(hf, shape)
    h, m, inter = "model.layers.1.mlp.", "decoder.layers.1.mlp.", model.config.moe_intermediate_size
    gate_up, down = hf[h + "experts.gate_up_proj"], hf[h + "experts.down_proj"]
    assert torch.equal(mc[m + "router.weight"], hf[h + "gate.weight"])
    x = torch.randn(5, model.config.hidden_size)
    for e in range(shape.num_experts):
        gate_e = torch.stack([gate_up[e, r] for r in range(inter)])  # HF's forward chunks gate first
        up_e = torch.stack([gate_up[e, inter + r] for r in range(inter)])
        fc1, fc2 = (mc[m + f"experts.local_experts.{e}.linear_fc{k}.weight"] for k in (1, 2))
        assert torch.equal(fc1, torch.cat([gate_e, up_e])) and torch.equal(fc2, down[e])
        g, u = (x @ fc1.T).chunk(2, dim=-1)  # megatron.core.transformer.mlp: glu
        routed = torch.full((5, 1), e), torch.ones(5, 1)
        with torch.no_grad():
            hf_out = model.model.layers[1].mlp.experts(x, *routed)
        torch.testing.assert_close((torch.nn.functional.silu(g) * u) @ fc2.T, hf_out)


@pytest.mark.parametrize("fused", [True, False], ids=["te_spec", "local_spec"])
def test_moe_layer_keeps_its_mlp_norm_apart_under_both_specs(fused):
    """TE's MoE layer spec keeps pre_mlp_layernorm (gpt_layer_specs: backend.layer_norm() if num_experts); only the
    attention norm is fused into linear_qkv."""
    model = hf_model("qwen3_moe")
    hf, shape = model.state_dict(), Shape.of(model.config, fused_norms=fused)
    mc = hf_to_megatron(hf, shape)
    for i in range(shape.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        assert torch.equal(mc[m + "pre_mlp_layernorm.weight"], hf[h + "post_attention_layernorm.weight"])
        assert m + "mlp.linear_fc1.layer_norm_weight" not in mc and m + "mlp.linear_fc1.weight" not in mc
        attn = "self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"
        assert torch.equal(mc[m + attn], hf[h + "input_layernorm.weight"])
        assert (m + "input_layernorm.weight" in mc) is not fused


def test_shape_refuses_qwen3_moe_with_dense_layers():
    with pytest.raises(ValueError, match="mlp_only_layers"):
        Shape.of(hf_model("qwen3_moe", mlp_only_layers=[1]).config)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fused", [True, False], ids=["te_spec", "local_spec"])
@pytest.mark.parametrize("arch", sorted(ARCH))
def test_megatron_to_hf_is_the_rollout_manifest_of_the_same_hf_model(arch, fused, tied):
    """The weight channel's digest covers names, shapes, dtypes and order; rollout builds its manifest from the
    HF model (hf_manifest for vLLM, the state dict for the hf engine), lm_head.weight included when tied."""
    model = hf_model(arch, tied)
    shape = Shape.of(model.config, fused_norms=fused)
    mc = hf_to_megatron(model.state_dict(), shape)
    assert ("output_layer.weight" in mc) is not tied  # a tied GPTModel on one stage has no output layer
    back = megatron_to_hf(mc, shape)
    assert Manifest.of(back) == hf_manifest(model) == Manifest.of(model.state_dict())
    assert torch.equal(back["lm_head.weight"], model.state_dict()["lm_head.weight"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp,pp,first,last", [(2, 1, None, None), (1, 2, None, None), (2, 2, None, None),
                                              (1, 2, 1, None), (1, 3, 1, 1)], ids=["tp2", "pp2", "tp2pp2",
                                                                                     "pp2_first1", "pp3_ends1"])
def test_tensor_and_pipeline_shards_merge_back_bit_for_bit(tp, pp, first, last, tied):
    model = hf_model("qwen2", tied)
    shape = Shape.of(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    layers = stage_layers(shape.num_layers, pp, first, last)
    stages = pp_split(mc, shape, layers)
    assert [len({n.split(".")[2] for n in stage if n.startswith("decoder.layers.")}) for stage in stages] == layers
    assert "embedding.word_embeddings.weight" in stages[0]
    # The last stage holds an output layer unless one stage holds both ends of a tied model.
    assert ("output_layer.weight" in stages[-1]) is (not tied or pp > 1)
    if tied and pp > 1:
        assert torch.equal(stages[-1]["output_layer.weight"], mc["embedding.word_embeddings.weight"])
    shards = [tp_split(stage, shape, tp) for stage in stages]
    qkv = shards[0][-1]["decoder.layers.0.self_attention.linear_qkv.weight"]  # last TP rank: the last groups
    per_group = (shape.num_heads // shape.num_kv_heads + 2) * shape.head_dim
    assert torch.equal(qkv, mc["decoder.layers.0.self_attention.linear_qkv.weight"][-qkv.shape[0]:])
    assert qkv.shape[0] == per_group * shape.num_kv_heads // tp
    merged = pp_merge([tp_merge(s, shape) for s in shards], shape, layers)
    assert merged.keys() == mc.keys() and all(torch.equal(merged[n], t) for n, t in mc.items())
    assert Manifest.of(megatron_to_hf(merged, shape)) == hf_manifest(model)


@pytest.mark.parametrize("num_layers,pp,first,last", [(8, 2, None, None), (8, 2, 3, None), (8, 2, None, 2),
                                                      (10, 4, 1, 3), (9, 4, 3, None), (7, 3, None, 1),
                                                      (6, 1, None, None)])
def test_stage_layers_are_where_megatron_core_builds_them(num_layers, pp, first, last):
    """The oracle is megatron-core's own get_num_layers_to_build, asked for each pipeline rank."""
    require_module("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    want = [get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)]
    assert stage_layers(num_layers, pp, first, last) == want


def test_stage_layers_refuse_a_split_megatron_would_refuse():
    with pytest.raises(ValueError, match="8 layers do not split over pipeline_model_parallel_size 3 with 1 on"):
        stage_layers(8, 3, 1, None)  # 7 left for 2 stages
    with pytest.raises(ValueError, match="do not split"):
        stage_layers(8, 2, 3, 3)


def experts_of(state: dict, layer: int) -> dict[int, tuple]:
    """Expert number -> (linear_fc1, linear_fc2) of one layer."""
    p = f"decoder.layers.{layer}.mlp.experts.local_experts."
    numbers = {int(n[len(p):].split(".")[0]) for n in state if n.startswith(p)}
    return {j: (state[f"{p}{j}.linear_fc1.weight"], state[f"{p}{j}.linear_fc2.weight"]) for j in numbers}


def test_tensor_parallel_split_keeps_experts_and_router_whole():
    model = hf_model("qwen3_moe")
    shape = Shape.of(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    shards = tp_split(mc, shape, 2)
    for shard in shards:
        assert shard.keys() == mc.keys()
        for name in mc:
            if is_expert(name) or name.endswith("mlp.router.weight"):
                assert torch.equal(shard[name], mc[name]), name
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"  # the rest still splits
        assert shard[qkv].shape[0] == mc[qkv].shape[0] // 2
    merged = tp_merge(shards, shape)
    assert merged.keys() == mc.keys() and all(torch.equal(merged[n], t) for n, t in mc.items())


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallel_ranks_hold_contiguous_expert_blocks_and_merge_back(ep):
    model = hf_model("qwen3_moe")
    shape = Shape.of(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    states = ep_split(mc, shape, ep)
    assert len(states) == ep
    per = shape.num_experts // ep
    for rank, state in enumerate(states):
        for layer in range(shape.num_layers):
            local, full = experts_of(state, layer), experts_of(mc, layer)
            assert sorted(local) == list(range(per))
            for j, (fc1, fc2) in local.items():  # EP rank r: global experts r·E/ep + j
                assert torch.equal(fc1, full[rank * per + j][0]) and torch.equal(fc2, full[rank * per + j][1])
        others = [n for n in mc if not is_expert(n)]
        assert [n for n in state if not is_expert(n)] == others
        assert all(torch.equal(state[n], mc[n]) for n in others)
    merged = ep_merge(states, shape)
    assert list(merged) == list(mc) and all(torch.equal(merged[n], t) for n, t in mc.items())
    # The trainer gathers the experts alone over the EP group (the rest over the TP group).
    experts = ep_merge([{n: t for n, t in state.items() if is_expert(n)} for state in states], shape)
    assert list(experts) == [n for n in mc if is_expert(n)]
    assert all(torch.equal(mc[n], t) for n, t in experts.items())
    assert not any(is_expert(f"decoder.layers.0.mlp.{n}.weight") for n in ("router", "linear_fc1", "linear_fc2"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_expert_and_tensor_shards_merge_back_bit_for_bit(tied):
    model = hf_model("qwen3_moe", tied)
    shape = Shape.of(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    pp, ep, tp = 2, 2, 2
    layers = stage_layers(shape.num_layers, pp)
    grid = [[tp_split(state, shape, tp) for state in ep_split(stage, shape, ep)]
            for stage in pp_split(mc, shape, layers)]
    # Stage 1, EP rank 1, TP rank 0: its layer 0 is global layer 2, its expert 0 global expert 2, whole.
    fc1 = grid[1][1][0]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(fc1, mc["decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight"])
    assert all(len(experts_of(shard, 0)) == shape.num_experts // ep
               for stage in grid for rank in stage for shard in rank)
    merged = pp_merge([ep_merge([tp_merge(shards, shape) for shards in stage], shape) for stage in grid], shape,
                      layers)
    assert merged.keys() == mc.keys() and all(torch.equal(merged[n], t) for n, t in mc.items())
    assert Manifest.of(megatron_to_hf(merged, shape)) == hf_manifest(model)


def test_expert_parallel_split_refuses_experts_it_cannot_divide_and_passes_dense_states_whole():
    moe = hf_model("qwen3_moe")
    shape = Shape.of(moe.config)
    with pytest.raises(ValueError, match="4 experts do not split over expert_model_parallel_size 3"):
        ep_split(hf_to_megatron(moe.state_dict(), shape), shape, 3)
    dense = hf_model("qwen3")
    shape = Shape.of(dense.config)
    mc = hf_to_megatron(dense.state_dict(), shape)
    states = ep_split(mc, shape, 2)
    assert len(states) == 2 and all(list(st) == list(mc) and all(st[n] is t for n, t in mc.items()) for st in states)
    assert ep_merge(states, shape) == states[0]


def test_tensor_parallel_split_refuses_a_vocabulary_it_cannot_divide():
    model = hf_model("llama", vocab_size=49)
    shape = Shape.of(model.config)
    with pytest.raises(ValueError, match="vocabulary of 49"):
        tp_split(hf_to_megatron(model.state_dict(), shape), shape, 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_megatron_backend_refuses_to_start_without_cuda():
    from services.common.config import load_config
    from services.trainer.backends import make_backend
    from services.trainer.distributed import RankInfo

    cfg = load_config(None, ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.tensor_model_parallel_size=2"])
    with pytest.raises(RuntimeError, match="needs CUDA"):
        make_backend(cfg, RankInfo(0, 1, 0))

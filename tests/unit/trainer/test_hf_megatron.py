"""HF <-> Megatron-Core weight conversion: bit for bit both ways, the grouped QKV layout against a
slow per-head reference, tensor/pipeline shards, the rollout's manifest (names, order, tied lm_head) of
the same HF model (a real GPTModel's: test_megatron_build.py)."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from services.common.infra import free_port
from services.common.weights.manifest import Manifest
from services.rollout.engines.vllm import hf_manifest
from services.trainer.backends.hf_megatron import (Shape, hf_to_megatron, megatron_to_hf, pp_merge, pp_split,
                                                   tp_merge, tp_split)

ARCH = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def hf_model(arch: str, tied: bool = False, vocab_size: int = 48):
    config = ARCH[arch](vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
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
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tensor_and_pipeline_shards_merge_back_bit_for_bit(tp, pp, tied):
    model = hf_model("qwen2", tied)
    shape = Shape.of(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    stages = pp_split(mc, shape, pp)
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
    merged = pp_merge([tp_merge(s, shape) for s in shards], shape)
    assert merged.keys() == mc.keys() and all(torch.equal(merged[n], t) for n, t in mc.items())
    assert Manifest.of(megatron_to_hf(merged, shape)) == hf_manifest(model)


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

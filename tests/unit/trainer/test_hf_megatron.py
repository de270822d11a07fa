"""HF <-> Megatron-Core weight conversion: bit for bit both ways, the grouped QKV layout against a
slow per-head reference, tensor/pipeline shards, and the names and shapes of a real GPTModel."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from services.common.infra import free_port
from services.trainer.backends.hf_megatron import (Shape, hf_to_megatron, megatron_to_hf, pp_merge, pp_split,
                                                   tp_merge, tp_split)

ARCH = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def hf_model(arch: str):
    config = ARCH[arch](vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
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
    assert back.keys() == hf.keys()
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


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_tensor_and_pipeline_shards_merge_back_bit_for_bit(tp, pp):
    model = hf_model("qwen2")
    shape = Shape.of(model.config)
    mc = hf_to_megatron(model.state_dict(), shape)
    stages = pp_split(mc, shape.num_layers, pp)
    assert "embedding.word_embeddings.weight" in stages[0] and "output_layer.weight" in stages[-1]
    shards = [tp_split(stage, shape, tp) for stage in stages]
    qkv = shards[0][-1]["decoder.layers.0.self_attention.linear_qkv.weight"]  # last TP rank: the last groups
    per_group = (shape.num_heads // shape.num_kv_heads + 2) * shape.head_dim
    assert torch.equal(qkv, mc["decoder.layers.0.self_attention.linear_qkv.weight"][-qkv.shape[0]:])
    assert qkv.shape[0] == per_group * shape.num_kv_heads // tp
    merged = pp_merge([tp_merge(s, shape) for s in shards], shape.num_layers)
    assert merged.keys() == mc.keys() and all(torch.equal(merged[n], t) for n, t in mc.items())


def test_names_and_shapes_match_a_real_megatron_core_gpt_model():
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = hf_model("qwen2")
    c = model.config
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        cfg = TransformerConfig(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                                num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
                                ffn_hidden_size=c.intermediate_size, gated_linear_unit=True,
                                activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                                add_bias_linear=False, add_qkv_bias=True, use_cpu_initialization=True)
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                       vocab_size=c.vocab_size, max_sequence_length=128, position_embedding_type="rope",
                       share_embeddings_and_output_weights=False)
        expected = {n: t.shape for n, t in gpt.state_dict().items() if not n.endswith("_extra_state")}
        mc = hf_to_megatron(model.state_dict(), Shape.of(c, fused_norms=False))
        assert {n: t.shape for n, t in mc.items()} == expected
        missing, unexpected = gpt.load_state_dict(mc, strict=False)
        assert not unexpected and all(n.endswith("_extra_state") for n in missing)
        back = megatron_to_hf({n: t for n, t in gpt.state_dict().items() if t is not None}, Shape.of(c, False))
        assert all(torch.equal(back[n], t) for n, t in model.state_dict().items())
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_megatron_backend_refuses_to_start_without_cuda():
    from services.common.config import load_config
    from services.trainer.backends import make_backend
    from services.trainer.distributed import RankInfo

    cfg = load_config(None, ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.tensor_model_parallel_size=2"])
    with pytest.raises(RuntimeError, match="needs CUDA"):
        make_backend(cfg, RankInfo(0, 1, 0))

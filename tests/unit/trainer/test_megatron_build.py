"""Building the Megatron-Core GPTModel on CPU with gloo, as the Megatron backend does on GPU: the local layer spec
(no Transformer Engine here), the TransformerConfig read back from the built model (dropout, dtypes, pipeline
dtype), every HF weight loaded and given back in the rollout manifest's order, PP = 2 and TP = 2 on two ranks,
RoPE against HF's own, the checkpoint directory, and the loss's vocab-parallel logprobs in chunks. The forward
pass, the training step and megatron-core's sharded save need CUDA (tests/gpu/)."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from needs import require_module
from transformers import LlamaConfig
from trainer_harness import run_ranks

require_module("megatron.core")
from megatron.core import parallel_state  # noqa: E402

from services.common.config import load_config  # noqa: E402
from services.common.infra import free_port  # noqa: E402
from services.common.modeling import load_policy  # noqa: E402
from services.common.weights.manifest import Manifest  # noqa: E402
from services.rollout.engines.vllm import hf_manifest  # noqa: E402
from services.trainer.backends.hf_megatron import Shape, megatron_to_hf  # noqa: E402
from services.trainer.backends.megatron import MegatronBackend, make_checkpoint_dir, micro_batches  # noqa: E402
from services.trainer.backends.megatron_model import (build_gpt, check_architecture, gather_hf,  # noqa: E402
                                                      rope_kwargs, te_available, vocab_parallel_logprobs)


def policy(*overrides: str):
    return load_config(None, ["policy.megatron_cfg.enabled=true", *overrides]).policy


def hf_model(p):
    model, _ = load_policy(p.model_copy(update={"precision": "float32"}), seed=0)
    for t in model.parameters():  # norms start at 1: make every tensor distinct
        torch.nn.init.normal_(t)
    return model


@pytest.fixture
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_layers_come_from_megatron_cores_local_spec_without_transformer_engine(one_rank):
    if te_available():
        pytest.skip("Transformer Engine is installed here: the backend takes its spec")
    _, gpt = build_gpt(hf_model(policy()), policy(), cpu=True)
    layer = gpt.decoder.layers[0]
    assert type(layer.self_attention.linear_qkv).__name__ == "ColumnParallelLinear"
    assert type(layer.self_attention.core_attention).__name__ == "DotProductAttention"
    assert type(layer.input_layernorm).__name__ == "RMSNorm"  # torch's, through WrappedTorchNorm


def test_bf16_policy_builds_bf16_parameters_in_float16module_without_dropout(one_rank):
    p = policy("policy.precision=bfloat16")
    module, gpt = build_gpt(hf_model(p), p, cpu=True)
    c = gpt.config
    assert (c.hidden_dropout, c.attention_dropout) == (0.0, 0.0)  # Megatron's default would be 0.1
    assert c.bf16 and not c.fp16 and c.params_dtype == c.pipeline_dtype == torch.bfloat16
    assert type(module).__name__ == "Float16Module" and module.module is gpt
    assert {t.dtype for t in gpt.parameters()} == {torch.bfloat16}


def test_float32_policy_builds_float32_parameters_unwrapped_and_dropout_follows_the_hf_config(one_rank):
    p = policy("policy.hf_config_overrides.attention_dropout=0.25")
    module, gpt = build_gpt(hf_model(p), p, cpu=True)
    assert module is gpt and not gpt.config.bf16 and gpt.config.pipeline_dtype == torch.float32
    assert {t.dtype for t in gpt.parameters()} == {torch.float32}
    assert (gpt.config.attention_dropout, gpt.config.hidden_dropout) == (0.25, 0.0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_built_model_holds_every_hf_weight_and_gives_them_back_in_manifest_order(one_rank, arch, tied):
    # head_dim 16, not hidden_size / heads = 32: as Qwen3's checkpoints, whose head_dim is its own key
    p = policy(f"policy.tiny.architecture={arch}", f"policy.hf_config_overrides.tie_word_embeddings={tied}",
               "policy.hf_config_overrides.head_dim=16")
    hf = hf_model(p)
    assert hf.config.tie_word_embeddings is tied and hf.model.layers[0].self_attn.o_proj.in_features == 32
    _, gpt = build_gpt(hf, p, cpu=True)
    assert (gpt.output_layer.weight is None) is tied  # Megatron multiplies by the embedding itself
    back = megatron_to_hf({n: t for n, t in gpt.state_dict().items() if t is not None}, Shape.of(hf.config, False))
    assert Manifest.of(back) == hf_manifest(hf)
    assert all(torch.equal(back[n], t) for n, t in hf.state_dict().items())


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_activation_checkpointing_recomputes_every_layer_as_nemo_rls_megatron_worker_sets_it(one_rank, on):
    """NeMo RL's worker, for megatron_cfg.activation_checkpointing: granularity full, method uniform, 1 layer.
    Only the built config is checked: the recomputing forward and backward need CUDA (tests/gpu/)."""
    p = policy(f"policy.activation_checkpointing={on}")
    _, gpt = build_gpt(hf_model(p), p, cpu=True)
    for c in (gpt.config, gpt.decoder.config):  # the block reads its own reference when it runs forward
        got = (c.recompute_granularity, c.recompute_method, c.recompute_num_layers)
        assert got == (("full", "uniform", 1) if on else (None, None, None))


def test_rope_base_is_the_hf_models(one_rank):
    """transformers 5 keeps rope_theta in rope_parameters; Qwen2.5 uses 1e6, not Megatron's default 1e4."""
    p = policy("policy.tiny.architecture=qwen2",
               "policy.hf_config_overrides.rope_parameters={rope_type: default, rope_theta: 1000000.0}")
    hf = hf_model(p)
    assert rope_kwargs(hf.config) == dict(rotary_base=1e6)
    _, gpt = build_gpt(hf, p, cpu=True)
    assert torch.allclose(gpt.rotary_pos_emb.inv_freq.float(), hf.model.rotary_emb.inv_freq.float())


def _parallel_rank(rank: int, tp: int, pp: int, hf_state: dict, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tp, pp)
    # Where the backend's save writes (checkpoint.py renames tmp_step_3 once every rank is done): rank 0 makes
    # it, and no rank goes on to megatron's writer, which refuses a missing directory, before it exists.
    target = Path(out).parent / "tmp_step_3" / "policy"
    make_checkpoint_dir(target)
    assert target.is_dir()
    p = parallel_policy(tp, pp)
    hf = hf_model(p)
    hf.load_state_dict(hf_state)
    _, gpt = build_gpt(hf, p, cpu=True)
    shards = [None, None]
    dist.all_gather_object(shards, sorted(gpt.state_dict()))
    back = gather_hf(gpt, Shape.of(hf.config, False))  # what the backend publishes from
    if rank == 0:
        torch.save({"back": back, "layers": len(gpt.decoder.layers), "pipeline_dtype": gpt.config.pipeline_dtype,
                    "names": shards, "qkv_rows": gpt.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]},
                   out)
    else:
        assert back == {}


def parallel_policy(tp: int, pp: int):
    """With PP 2, uneven stages (NeMo RL's num_layers_in_first_pipeline_stage): 1 layer on the first, 3 on the last."""
    return policy("policy.precision=bfloat16", "policy.tiny.num_hidden_layers=4", "policy.tiny.num_attention_heads=4",
                  f"policy.megatron_cfg.tensor_model_parallel_size={tp}",
                  f"policy.megatron_cfg.pipeline_model_parallel_size={pp}",
                  *(["policy.megatron_cfg.num_layers_in_first_pipeline_stage=1"] if pp > 1 else []))


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["pp2", "tp2"])
def test_two_gloo_ranks_build_their_shards_give_every_weight_back_and_make_the_checkpoint_dir(tmp_path, tp, pp):
    """Untied only: a tied model's last pipeline stage moves its output layer to CUDA in GPTModel's
    constructor (setup_embeddings_and_output_layer), so PP = 2 tied is left to tests/gpu/."""
    hf = hf_model(parallel_policy(tp, pp))
    run_ranks(2, _parallel_rank, tp, pp, hf.state_dict(), str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    assert got["layers"] == (1 if pp == 2 else 4) and got["pipeline_dtype"] == torch.bfloat16
    first, last = got["names"]
    if pp == 2:
        assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
        assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    else:  # 4 heads, 4 groups of (1 query + key + value) heads of 16 rows, half on each rank
        assert first == last and got["qkv_rows"] == 2 * 3 * 16
    hf = hf.to(torch.bfloat16)  # as the bf16 GPTModel holds it
    assert Manifest.of(got["back"]) == hf_manifest(hf)
    assert all(torch.equal(got["back"][n], t) for n, t in hf.state_dict().items())


def moe_policy(*overrides: str):
    """Qwen3-MoE; megatron's alltoall dispatcher makes a CUDA stream when it is built, so allgather here."""
    return policy("policy.tiny.architecture=qwen3_moe", "policy.megatron_cfg.moe_token_dispatcher_type=allgather",
                  *overrides)


@pytest.mark.parametrize("norm_topk_prob,freeze", [(False, True), (True, False)], ids=["pre_softmax", "top_k_first"])
def test_a_qwen3_moe_policy_builds_megatrons_router_and_experts_and_gives_every_weight_back(one_rank, norm_topk_prob,
                                                                                              freeze):
    p = moe_policy(f"policy.hf_config_overrides.norm_topk_prob={norm_topk_prob}",
                   "policy.megatron_cfg.moe_router_dtype=fp64", f"policy.megatron_cfg.freeze_moe_router={freeze}")
    hf = hf_model(p)
    _, gpt = build_gpt(hf, p, cpu=True)
    c, layer = gpt.config, gpt.decoder.layers[0]
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size, c.moe_router_dtype) == (
        hf.config.num_experts, hf.config.num_experts_per_tok, hf.config.moe_intermediate_size, "fp64")
    # HF: softmax over all experts, top k, renormalised if norm_topk_prob; megatron without pre-softmax: top k of
    # the logits, softmax over those k, which is the renormalised one
    assert c.moe_router_pre_softmax is not norm_topk_prob
    assert type(layer.mlp).__name__ == "MoELayer" and type(layer.mlp.experts).__name__ == "SequentialMLP"
    assert len(layer.mlp.experts.local_experts) == hf.config.num_experts
    routers = [w for n, w in gpt.named_parameters() if n.endswith("mlp.router.weight")]
    assert len(routers) == hf.config.num_hidden_layers and all(w.requires_grad is not freeze for w in routers)
    back = megatron_to_hf({n: t for n, t in gpt.state_dict().items() if t is not None}, Shape.of(hf.config, False))
    assert Manifest.of(back) == hf_manifest(hf)
    assert all(torch.equal(back[n], t) for n, t in hf.state_dict().items())


def test_a_router_bias_is_refused_for_a_moe_model_and_changes_nothing_for_a_dense_one(one_rank):
    p = moe_policy("policy.megatron_cfg.moe_router_enable_expert_bias=true")
    with pytest.raises(ValueError, match="moe_router_enable_expert_bias: .* \\(qwen3_moe\\) have no router bias"):
        build_gpt(hf_model(p), p, cpu=True)
    p = policy("policy.megatron_cfg.moe_router_enable_expert_bias=true")
    build_gpt(hf_model(p), p, cpu=True)


def _moe_ranks(rank: int, hf_state: dict, out: str) -> None:
    """TP 2 x EP 2 with sequence parallelism over 4 ranks: the experts each holds, its norms, the gathered weights;
    then the same ranks as PP 2 x DP 2 for the step's metrics."""
    dist.init_process_group("gloo", rank=rank, world_size=4)
    parallel_state.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    p = moe_parallel_policy()
    hf = hf_model(p)
    hf.load_state_dict(hf_state)
    _, gpt = build_gpt(hf, p, cpu=True)
    norms = {n: (type(m).__name__, getattr(m.weight, "sequence_parallel", None)) for n, m in gpt.named_modules()
             if isinstance(m, torch.nn.RMSNorm)}
    info = dict(ep=parallel_state.get_expert_model_parallel_rank(), tp=parallel_state.get_tensor_model_parallel_rank(),
                tp_group=dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()),
                experts=[e.linear_fc1.weight.detach() for e in gpt.decoder.layers[1].mlp.experts.local_experts],
                norms=norms, sequence_parallel=gpt.config.sequence_parallel)
    infos = [None] * 4
    dist.all_gather_object(infos, info)
    back = gather_hf(gpt, Shape.of(hf.config, False))
    assert (back == {}) is (info["tp"] != 0)  # the first tensor-parallel rank of each data-parallel replica
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 2)
    last, dp_rank = parallel_state.is_pipeline_last_stage(), parallel_state.get_data_parallel_rank()
    reports = [{"loss": 1.0 + dp_rank, "probs_ratio_min": 0.5 + dp_rank, "probs_ratio_max": 2.0 + dp_rank},
               {"loss": 10.0, "probs_ratio_min": 0.9, "probs_ratio_max": 1.1}] if last else []  # the schedule's
    metrics = [None] * 4
    dist.all_gather_object(metrics, MegatronBackend._step_metrics(SimpleNamespace(ps=parallel_state, pp=2), reports))
    if rank == 0:
        torch.save({"back": back, "infos": infos, "metrics": metrics}, out)


def moe_parallel_policy():
    return moe_policy("policy.precision=bfloat16", "policy.tiny.num_hidden_layers=2",
                      "policy.tiny.num_attention_heads=4", "policy.megatron_cfg.tensor_model_parallel_size=2",
                      "policy.megatron_cfg.expert_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true")


def test_four_gloo_ranks_split_experts_and_tensors_with_sequence_parallel_norms_and_give_every_weight_back(tmp_path):
    hf = hf_model(moe_parallel_policy())
    run_ranks(4, _moe_ranks, hf.state_dict(), str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    infos, hf = got["infos"], hf.to(torch.bfloat16)  # as the bf16 GPTModel holds it
    # the case gather_hf must get right: megatron puts the two expert blocks in each tensor-parallel group
    assert all(len({infos[r]["ep"] for r in i["tp_group"]}) == 2 for i in infos)
    per = hf.config.num_experts // 2
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj
    for i in infos:  # whole experts, the EP rank's block of them
        assert len(i["experts"]) == per
        for j, weight in enumerate(i["experts"]):
            assert torch.equal(weight, gate_up[i["ep"] * per + j])
    for i in infos:  # every norm, the final one and the q/k ones included, sums its gradient over the TP group
        assert i["sequence_parallel"] and i["norms"] and set(i["norms"].values()) == {("SequenceParallelRMSNorm", True)}
        assert "decoder.final_layernorm" in i["norms"] and "decoder.layers.0.self_attention.q_layernorm" in i["norms"]
    assert Manifest.of(got["back"]) == hf_manifest(hf)
    assert all(torch.equal(got["back"][n], t) for n, t in hf.state_dict().items())
    # the step's metrics, from the last stage's micro-batches of both data-parallel ranks, on every rank
    assert got["metrics"] == [{"loss": 23.0, "probs_ratio_min": 0.5, "probs_ratio_max": 3.0}] * 4


def test_micro_batches_split_each_data_parallel_ranks_rows_and_every_rank_refuses_a_batch_one_cannot_take():
    assert micro_batches(10, 1, 2, 2, pp=1) == [[1, 3], [5, 7], [9]]
    assert micro_batches(8, 0, 2, 2, pp=2) == [[0, 2], [4, 6]]
    # 6 rows over 4 ranks at PP 2: ranks 0 and 1 would have a full micro-batch, 2 and 3 a short one. Each must
    # refuse, or those that went on would wait in the schedule's collectives for those that stopped.
    for rank in range(4):
        with pytest.raises(ValueError, match="exactly train_micro_batch_size 2 rows on each of 4 .* 6 rows"):
            micro_batches(6, rank, 4, 2, pp=2)
    for rank in range(2):  # one row for two ranks: the second would have none, and the schedule needs one
        with pytest.raises(ValueError, match="a batch of 1 rows cannot give each of 2"):
            micro_batches(1, rank, 2, 1, pp=1)


def test_what_the_built_model_would_compute_differently_from_hf_is_refused():
    llama31 = dict(rope_type="llama3", rope_theta=5e5, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    assert rope_kwargs(LlamaConfig(rope_parameters=llama31)) == dict(
        rotary_base=5e5, rope_scaling=True, rope_scaling_factor=32.0)
    with pytest.raises(ValueError, match="llama3 scaling only"):  # megatron fixes the three at Llama 3.1's
        rope_kwargs(LlamaConfig(rope_parameters=llama31 | dict(high_freq_factor=2.0)))
    with pytest.raises(ValueError, match="llama3 scaling only"):
        rope_kwargs(LlamaConfig(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)))
    with pytest.raises(ValueError, match="o_proj and MLP biases"):
        check_architecture(LlamaConfig(attention_bias=True))


@pytest.mark.parametrize("chunk", [None, 3, 4, 64])
def test_vocab_parallel_logprobs_in_chunks_equal_log_softmax_in_values_and_gradients(one_rank, chunk):
    """megatron-core's vocab-parallel cross entropy (one TP rank) chunk by chunk (policy.logprob_chunk_size) against
    torch's log_softmax over the whole sequence, bfloat16 logits as the model gives them."""
    torch.manual_seed(0)
    logits = torch.randn(2, 10, 32).bfloat16().requires_grad_()
    targets, upstream = torch.randint(0, 32, (2, 10)), torch.randn(2, 10)
    want = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    (want_grad,) = torch.autograd.grad((want * upstream).sum(), logits)
    got = vocab_parallel_logprobs(logits, targets, 0.7, chunk)
    (got_grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=0, atol=1e-2)

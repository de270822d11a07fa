"""Build the Megatron-Core GPTModel of a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE policy (megatron-core 0.16).

    HF config + policy ──transformer_config──▶ TransformerConfig (dims, dropout, dtypes, TP/PP/EP, routing)
    layer_spec: Transformer Engine's modules when transformer_engine imports, else Megatron-Core's own (with a
                norm that takes sequence parallelism and an attention that takes context parallelism, which
                megatron's own refuse without TE)
    build_gpt: GPTModel for this rank's pipeline stage ◀── its PP/EP/TP shard of the HF weights (hf_megatron.py)
               └─ Float16Module around it under bf16/fp16, as Megatron-LM's training does
    gather_hf: every rank's shard ──▶ the HF state dict in the rollout manifest's order

Qwen3-MoE's routing in Megatron-Core's terms: softmax over every expert then the top k, renormalised when the HF
config says norm_topk_prob, equals megatron's top k of the logits then softmax over those k
(moe_router_pre_softmax false); without renormalisation it is megatron's pre-softmax routing. Experts are
SequentialMLPs (one MLP per expert, no grouped GEMM), so the state dict keeps one linear_fc1/fc2 per expert.

Everything here runs on CPU as well (`cpu=True`: use_cpu_initialization) with gloo process groups, and is tested
there (tests/unit/trainer/test_megatron_build.py); the forward pass and the DDP wrapper need CUDA.
"""

from __future__ import annotations

import logging

import torch

from services.common.config import PolicyConfig
from services.trainer.backends.hf_megatron import (Shape, ep_merge, ep_split, hf_to_megatron, is_expert,
                                                   megatron_to_hf, pp_merge, pp_split, stage_layers, tp_merge,
                                                   tp_split)

log = logging.getLogger("flywheel.trainer.megatron")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def te_available() -> bool:
    """Whether megatron-core found Transformer Engine (nothing in Flywheel's extras installs it)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.HAVE_TE


def layer_spec(te: bool, tconfig):
    """The decoder's modules: the TE spec fuses the RMSNorms into linear_qkv and a dense linear_fc1; the local spec
    keeps them apart (torch's RMSNorm, or SequenceParallelRMSNorm under sequence parallelism) and attends with
    megatron's DotProductAttention, or ContextParallelAttention under context parallelism. MoE layers get
    Megatron-Core's router and SequentialMLP experts."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from services.trainer.backends.megatron_context_parallel import ContextParallelAttention

    experts = dict(num_experts=tconfig.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=tconfig.qk_layernorm)
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(**experts)
    layer = specs.get_gpt_layer_local_spec(**experts, normalization="RMSNorm")
    swaps = ({WrappedTorchNorm: SequenceParallelRMSNorm} if tconfig.sequence_parallel else {}) | (
        {DotProductAttention: ContextParallelAttention} if tconfig.context_parallel_size > 1 else {})
    if not swaps:
        return layer
    # The final norm too: megatron picks the block's from what is installed, which here is its torch norm.
    return TransformerBlockSubmodules(layer_specs=[_swap(layer, swaps)] * get_num_layers_to_build(tconfig),
                                      layer_norm=swaps.get(WrappedTorchNorm, WrappedTorchNorm))


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, built as megatron builds its norms, for sequence parallelism: it normalises each position
    on its own, so a slice of the sequence is as good as the whole, but each tensor-parallel rank then sees only its
    slice's gradient. The `sequence_parallel` mark has finalize_model_grads sum the weight's gradient over the
    tensor-parallel group, as megatron's apex and TE norms are marked; its torch norm refuses sequence parallelism."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _swap(spec, swaps: dict):
    """`spec` with each module class in `swaps` replaced wherever it appears (every norm, q/k norms included; the
    core attention)."""
    import dataclasses

    if isinstance(spec, type):
        return swaps.get(spec, spec)
    if dataclasses.is_dataclass(spec):
        return dataclasses.replace(spec, **{f.name: _swap(getattr(spec, f.name), swaps)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def check_architecture(c) -> None:
    """Refuse, at build, what the conversion would silently drop or Megatron would compute differently."""
    if c.model_type not in ARCHITECTURES:
        raise ValueError(f"the Megatron backend converts {', '.join(ARCHITECTURES)} models, not {c.model_type!r}")
    if c.model_type == "llama" and (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias or mlp_bias: o_proj and MLP biases have no place in the "
                         "Megatron GPTModel built here (add_bias_linear=False)")
    Shape.of(c)  # refuses Qwen3-MoE with dense layers among the MoE ones
    rope_kwargs(c)


def rope_kwargs(c) -> dict:
    """GPTModel's RoPE arguments from the HF config (transformers 5 keeps them in rope_parameters)."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return dict(rotary_base=theta)
    # Megatron-Core's llama3 scaling fixes these three at Llama 3.1's values; only the factor is free.
    llama31 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    if kind == "llama3" and all(float(rope.get(k, -1)) == v for k, v in llama31.items()):
        return dict(rotary_base=theta, rope_scaling=True, rope_scaling_factor=rope["factor"])
    raise ValueError(f"RoPE {rope}: the Megatron backend builds default RoPE and Llama 3.1's llama3 scaling only")


def model_dtype(policy: PolicyConfig) -> torch.dtype:
    return getattr(torch, policy.precision)


def transformer_config(c, policy: PolicyConfig, te: bool, cpu: bool = False):
    """TransformerConfig of HF config `c` under `policy`: its dims; dropout from the HF config (0 for Llama and
    Qwen: Megatron's own default is 0.1, which HF models never trained with; policy.hf_config_overrides can set
    attention_dropout / hidden_dropout); parameters, pipeline messages and the bf16/fp16 flags in
    policy.precision; policy.activation_checkpointing recomputes every layer in the backward, as NeMo RL's Megatron
    worker sets it (full granularity, uniform, one layer per unit)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, s, dtype = policy.megatron_cfg, Shape.of(c), model_dtype(policy)
    fusion = bool(getattr(m, "apply_rope_fusion", False))
    if fusion and not te:
        log.warning("megatron_cfg.apply_rope_fusion needs Transformer Engine, which is not installed: unfused RoPE")
    moe = dict(num_moe_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
               moe_ffn_hidden_size=c.moe_intermediate_size, moe_router_pre_softmax=not c.norm_topk_prob,
               moe_grouped_gemm=False, moe_token_dispatcher_type=m.moe_token_dispatcher_type,
               moe_router_dtype=m.moe_router_dtype, moe_router_load_balancing_type=m.moe_router_load_balancing_type,
               moe_aux_loss_coeff=m.moe_aux_loss_coeff,
               expert_model_parallel_size=m.expert_model_parallel_size, expert_tensor_parallel_size=1
               ) if s.num_experts else {}
    return TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_attention_heads=s.num_heads, num_query_groups=s.num_kv_heads, kv_channels=s.head_dim,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps, add_bias_linear=False, qk_layernorm=s.qk_norm,
        add_qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
        hidden_dropout=float(getattr(c, "hidden_dropout", 0.0)), apply_rope_fusion=fusion and te,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size, context_parallel_size=m.context_parallel_size,
        # megatron refuses them at PP 1, where a single stage holds every layer anyway
        **{k: getattr(m, k) if m.pipeline_model_parallel_size > 1 else None
           for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")},
        sequence_parallel=m.sequence_parallel and m.tensor_model_parallel_size > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu, **recompute(policy.activation_checkpointing), **moe)


def recompute(on: bool) -> dict:
    """TransformerConfig's recompute fields: whole layers, each its own unit (memory for a second forward)."""
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if on else {}


def build_gpt(hf, policy: PolicyConfig, cpu: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(module to train, the GPTModel inside it) for this rank's stage, holding its shard of `hf`'s weights.

    Needs megatron's parallel state initialised. The module is the GPTModel itself in float32, else the
    GPTModel in Float16Module (bf16/fp16 parameters, fp32 logits), which DDP then wraps on GPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    c = hf.config
    check_architecture(c)
    if policy.megatron_cfg.moe_router_enable_expert_bias and Shape.of(c).num_experts:
        raise ValueError("policy.megatron_cfg.moe_router_enable_expert_bias: the Hugging Face weights rollout loads "
                         f"({c.model_type}) have no router bias, so rollout would route differently")
    te = te_available()
    tconfig = transformer_config(c, policy, te, cpu)
    gpt = GPTModel(config=tconfig, transformer_layer_spec=layer_spec(te, tconfig),
                   vocab_size=c.vocab_size, max_sequence_length=policy.max_total_sequence_length,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=bool(c.tie_word_embeddings), position_embedding_type="rope",
                   **rope_kwargs(c))
    if not cpu:  # as Megatron-LM's get_model does: the local spec's norms (torch.nn.RMSNorm) are built on the host
        gpt.cuda(torch.cuda.current_device())
    load_shard(gpt, hf.state_dict(), Shape.of(c, fused_norms=te))
    if policy.megatron_cfg.freeze_moe_router:  # before DDP and the optimizer, which take what requires grad
        for name, weight in gpt.named_parameters():
            if name.endswith("mlp.router.weight"):
                weight.requires_grad_(False)
    module = Float16Module(tconfig, gpt) if tconfig.bf16 or tconfig.fp16 else gpt
    return module, gpt


def load_shard(gpt: torch.nn.Module, hf_state: dict[str, torch.Tensor], shape: Shape) -> None:
    """Copy this rank's pipeline stage, experts and tensor shard of the HF weights into `gpt` (cast to its dtype)."""
    from megatron.core import parallel_state as ps

    stages = pp_split(hf_to_megatron(hf_state, shape), shape, layers_per_stage(gpt.config))
    experts = ep_split(stages[ps.get_pipeline_model_parallel_rank()], shape, ps.get_expert_model_parallel_world_size())
    shards = tp_split(experts[ps.get_expert_model_parallel_rank()], shape, ps.get_tensor_model_parallel_world_size())
    missing, unexpected = gpt.load_state_dict(shards[ps.get_tensor_model_parallel_rank()], strict=False)
    if unexpected or any(not n.endswith("_extra_state") for n in missing):
        raise RuntimeError(f"HF -> Megatron weights do not fit: missing {missing}, unexpected {unexpected}")


def gather_hf(gpt: torch.nn.Module, shape: Shape) -> dict[str, torch.Tensor]:
    """Collective over this rank's tensor, expert and pipeline groups: every shard of `gpt`, as HF weights (on the
    host, names in HF's order), on the first tensor-parallel rank of the first pipeline stage of each data-parallel
    replica (the backend publishes global rank 0's); {} elsewhere. The tensor group merges
    the dense weights (a tensor group's ranks may hold different experts), the expert group the experts (whole on
    each rank), then the pipeline group the stages."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = {k: v.detach().cpu() for k, v in gpt.state_dict().items()
             if v is not None and not k.endswith("_extra_state")}
    dense = {k: v for k, v in local.items() if not is_expert(k)}
    shards = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(shards, dense, group=ps.get_tensor_model_parallel_group())
    experts = [None] * ps.get_expert_model_parallel_world_size()
    dist.all_gather_object(experts, {k: v for k, v in local.items() if is_expert(k)},
                           group=ps.get_expert_model_parallel_group())
    stage = tp_merge(shards, shape) | ep_merge(experts, shape)
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, stage, group=ps.get_pipeline_model_parallel_group())
    if ps.get_pipeline_model_parallel_rank() or ps.get_tensor_model_parallel_rank():
        return {}
    return megatron_to_hf(pp_merge(stages, shape, layers_per_stage(gpt.config)), shape)


def layers_per_stage(tconfig) -> list[int]:
    """How many decoder layers each pipeline stage of a model built with `tconfig` holds."""
    return stage_layers(tconfig.num_layers, tconfig.pipeline_model_parallel_size,
                        tconfig.num_layers_in_first_pipeline_stage, tconfig.num_layers_in_last_pipeline_stage)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                            chunk: int | None) -> torch.Tensor:
    """[B, T] logprobs of `targets` under softmax(logits / T) over this rank's vocabulary shard and its TP group's,
    in float32. `chunk` (policy.logprob_chunk_size) positions at a time, each recomputed in backward, so forward and
    backward hold one chunk's float32 [B, chunk, V / TP] rather than the whole sequence's; None: all at once."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def part(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -vocab_parallel_cross_entropy((x.float() / temperature).contiguous(), y)

    if chunk is None or chunk >= targets.shape[1]:
        return part(logits, targets)
    return torch.cat([torch.utils.checkpoint.checkpoint(part, logits[:, s:s + chunk], targets[:, s:s + chunk],
                                                        use_reentrant=False)
                      for s in range(0, targets.shape[1], chunk)], dim=1)

"""Build the Megatron-Core GPTModel of a Hugging Face Llama / Qwen2 / Qwen3 policy (megatron-core 0.16).

    HF config + policy ──transformer_config──▶ TransformerConfig (dims, dropout, dtypes, TP/PP)
    layer_spec: Transformer Engine's modules when transformer_engine imports, else Megatron-Core's own
    build_gpt: GPTModel for this rank's pipeline stage ◀── its TP/PP shard of the HF weights (hf_megatron.py)
               └─ Float16Module around it under bf16/fp16, as Megatron-LM's training does
    gather_hf: every rank's shard ──▶ the HF state dict in the rollout manifest's order

Everything here runs on CPU as well (`cpu=True`: use_cpu_initialization) with gloo process groups, and is tested
there (tests/unit/trainer/test_megatron_build.py); the forward pass and the DDP wrapper need CUDA.
"""

from __future__ import annotations

import logging

import torch

from services.common.config import MegatronConfig, PolicyConfig
from services.trainer.backends.hf_megatron import (Shape, hf_to_megatron, megatron_to_hf, pp_merge, pp_split,
                                                   tp_merge, tp_split)

log = logging.getLogger("flywheel.trainer.megatron")
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def te_available() -> bool:
    """Whether megatron-core found Transformer Engine (nothing in Flywheel's extras installs it)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.HAVE_TE


def te_only(m: MegatronConfig) -> list[str]:
    """What `m` asks for that megatron-core 0.16 does only with Transformer Engine. Refused with or without it:
    neither is wired into this backend (Flywheel's extras do not install TE). The keys are NeMo RL's
    megatron_cfg names; one the schema does not hold counts as unset."""
    reasons = []
    if getattr(m, "context_parallel_size", 1) > 1:
        reasons.append("context_parallel_size > 1 (the local spec's DotProductAttention has no context parallelism)")
    fp8 = getattr(m, "fp8_cfg", None) or {}
    if fp8.get("enabled") if isinstance(fp8, dict) else getattr(fp8, "enabled", False):
        reasons.append("fp8_cfg.enabled (FP8 GEMMs are Transformer Engine's)")
    return reasons


def layer_spec(te: bool, qk_norm: bool):
    """The decoder layer's modules; the TE spec fuses the two RMSNorms into linear_qkv and linear_fc1."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    return specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")


def check_architecture(c) -> None:
    """Refuse, at build, what the conversion would silently drop or Megatron would compute differently."""
    if c.model_type not in ARCHITECTURES:
        raise ValueError(f"the Megatron backend converts {', '.join(ARCHITECTURES)} models, not {c.model_type!r}")
    if c.model_type == "llama" and (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias or mlp_bias: o_proj and MLP biases have no place in the "
                         "Megatron GPTModel built here (add_bias_linear=False)")
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
    return TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_attention_heads=s.num_heads, num_query_groups=s.num_kv_heads, kv_channels=s.head_dim,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps, add_bias_linear=False, qk_layernorm=s.qk_norm,
        add_qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        attention_dropout=float(getattr(c, "attention_dropout", 0.0)),
        hidden_dropout=float(getattr(c, "hidden_dropout", 0.0)), apply_rope_fusion=fusion and te,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=cpu, **recompute(policy.activation_checkpointing))


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
    if refused := te_only(policy.megatron_cfg):
        raise ValueError("policy.megatron_cfg asks for what only Transformer Engine provides, which this backend "
                         "does not build: " + "; ".join(refused))
    te = te_available()
    tconfig = transformer_config(c, policy, te, cpu)
    gpt = GPTModel(config=tconfig, transformer_layer_spec=layer_spec(te, Shape.of(c).qk_norm),
                   vocab_size=c.vocab_size, max_sequence_length=policy.max_total_sequence_length,
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                   share_embeddings_and_output_weights=bool(c.tie_word_embeddings), position_embedding_type="rope",
                   **rope_kwargs(c))
    if not cpu:  # as Megatron-LM's get_model does: the local spec's norms (torch.nn.RMSNorm) are built on the host
        gpt.cuda(torch.cuda.current_device())
    load_shard(gpt, hf.state_dict(), Shape.of(c, fused_norms=te))
    module = Float16Module(tconfig, gpt) if tconfig.bf16 or tconfig.fp16 else gpt
    return module, gpt


def load_shard(gpt: torch.nn.Module, hf_state: dict[str, torch.Tensor], shape: Shape) -> None:
    """Copy this rank's pipeline stage and tensor shard of the HF weights into `gpt` (cast to its dtype)."""
    from megatron.core import parallel_state as ps

    stages = pp_split(hf_to_megatron(hf_state, shape), shape, ps.get_pipeline_model_parallel_world_size())
    shards = tp_split(stages[ps.get_pipeline_model_parallel_rank()], shape, ps.get_tensor_model_parallel_world_size())
    missing, unexpected = gpt.load_state_dict(shards[ps.get_tensor_model_parallel_rank()], strict=False)
    if unexpected or any(not n.endswith("_extra_state") for n in missing):
        raise RuntimeError(f"HF -> Megatron weights do not fit: missing {missing}, unexpected {unexpected}")


def gather_hf(gpt: torch.nn.Module, shape: Shape) -> dict[str, torch.Tensor]:
    """Collective over this rank's tensor and pipeline groups: every shard of `gpt`, as HF weights (on the host,
    names in HF's order), on the first rank of the pipeline group; {} elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = {k: v.detach().cpu() for k, v in gpt.state_dict().items()
             if v is not None and not k.endswith("_extra_state")}
    shards = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(shards, local, group=ps.get_tensor_model_parallel_group())
    stages = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, tp_merge(shards, shape), group=ps.get_pipeline_model_parallel_group())
    if ps.get_pipeline_model_parallel_rank() or ps.get_tensor_model_parallel_rank():
        return {}
    return megatron_to_hf(pp_merge(stages, shape), shape)


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

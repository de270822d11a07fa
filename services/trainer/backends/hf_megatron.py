"""Hugging Face <-> Megatron-Core GPTModel weights for Llama-, Qwen2/3- and Qwen3-MoE-style models (pure, no IO).

    HF (one layer i)                          Megatron-Core (decoder.layers.i.)
    self_attn.{q,k,v}_proj.weight/bias  <->   self_attention.linear_qkv.weight/bias   (grouped, below)
    self_attn.o_proj.weight             <->   self_attention.linear_proj.weight
    mlp.{gate,up}_proj.weight           <->   mlp.linear_fc1.weight                   [gate; up]
    mlp.down_proj.weight                <->   mlp.linear_fc2.weight
    input_layernorm.weight              <->   input_layernorm.weight                 (local spec)
                                              self_attention.linear_qkv.layer_norm_weight (TE spec, fused)
    post_attention_layernorm.weight     <->   pre_mlp_layernorm.weight               (local spec)
                                              mlp.linear_fc1.layer_norm_weight       (TE spec, fused)
    self_attn.{q,k}_norm.weight         <->   self_attention.{q,k}_layernorm.weight   (Qwen3)

    Qwen3-MoE (every layer MoE; E experts; SequentialMLP experts, no grouped GEMM), instead of the MLP rows:
    mlp.gate.weight [E, H]              <->   mlp.router.weight
    mlp.experts.gate_up_proj [E, 2I, H] <->   mlp.experts.local_experts.e.linear_fc1.weight = gate_up_proj[e]
                                              (already [gate; up], as HF's forward chunks it)
    mlp.experts.down_proj [E, H, I]     <->   mlp.experts.local_experts.e.linear_fc2.weight = down_proj[e]
    post_attention_layernorm.weight     <->   pre_mlp_layernorm.weight  (both specs: TE's MoE layer keeps the
                                              MLP norm apart; the attention norm stays fused)
    model.embed_tokens / model.norm / lm_head <-> embedding.word_embeddings / decoder.final_layernorm / output_layer

Tied models (tie_word_embeddings) have no output_layer on a stage that holds the embedding: Megatron
multiplies by the embedding itself. With pipeline stages, the last stage keeps its own copy, which
Megatron keeps equal by summing the two gradients (finalize_model_grads); that copy is dropped on the
way back. HF's state dict still lists a tied lm_head.weight (state_dict does not deduplicate aliases),
so megatron_to_hf emits it, as the embedding, where HF lists it.

megatron_to_hf yields the names in the order of the HF model's own state dict: the weight channel's
manifest is that order (services/common/weights/manifest.py), and its digest covers the order.

linear_qkv holds, for each of the G key/value groups in turn, that group's H/G query heads,
then its key head, then its value head (Megatron splits it back the same way in attention).
Every conversion only reshapes and concatenates, so HF -> Megatron -> HF is bit for bit.

Tensor parallelism: column-parallel weights (linear_qkv by whole groups, linear_fc1 as
[gate shard; up shard], embeddings and output_layer by vocabulary rows) split on dim 0,
row-parallel ones (linear_proj, linear_fc2) on dim 1, norms are replicated. Experts and the
router are replicated too (expert_tensor_parallel_size 1: each TP rank holds whole experts).
Pipeline parallelism: each stage holds consecutive layers, numbered from 0 on the stage.
Expert parallelism: EP rank r holds each layer's experts r·E/ep .. (r+1)·E/ep - 1, numbered from 0 on
the rank; every other tensor (the router included) is on every EP rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Shape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    fused_norms: bool = True
    """Transformer Engine spec (norm weights inside linear_qkv / linear_fc1); False: the local spec."""
    tied: bool = False
    """tie_word_embeddings: lm_head is the embedding."""
    qk_norm: bool = False
    """RMSNorm on each query and key head (Qwen3)."""
    vocab_size: int = 0
    """Embedding rows."""
    num_experts: int = 0
    """Experts per MoE layer (Qwen3-MoE); 0: a dense MLP. When > 0 every layer is MoE: mixed dense/MoE
    stacks (mlp_only_layers, decoder_sparse_step != 1) are not converted."""

    @classmethod
    def of(cls, hf_config, fused_norms: bool = True) -> Shape:
        """From a transformers LlamaConfig / Qwen2Config / Qwen3Config / Qwen3MoeConfig."""
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        moe = hf_config.model_type == "qwen3_moe"
        if moe and (hf_config.mlp_only_layers or hf_config.decoder_sparse_step != 1):
            raise ValueError("Qwen3-MoE dense layers (mlp_only_layers, decoder_sparse_step != 1) are not converted")
        return cls(hf_config.num_hidden_layers, heads, hf_config.num_key_value_heads or heads, head_dim, fused_norms,
                   tied=bool(hf_config.tie_word_embeddings), qk_norm=hf_config.model_type in ("qwen3", "qwen3_moe"),
                   vocab_size=hf_config.vocab_size, num_experts=hf_config.num_experts if moe else 0)


def _norm_names(s: Shape) -> tuple[str, str]:
    """TE fuses the attention norm into linear_qkv, and a dense MLP's into linear_fc1; a MoE layer's MLP
    norm stays its own pre_mlp_layernorm (the experts' linear_fc1 are plain linears)."""
    if not s.fused_norms:
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"
    return ("self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight" if s.num_experts else "mlp.linear_fc1.layer_norm_weight")


def _expert(m: str, e: int) -> str:
    return f"{m}mlp.experts.local_experts.{e}."


def _qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, s: Shape) -> Tensor:
    """[H·d, ...], [G·d, ...], [G·d, ...] -> [(H + 2G)·d, ...] grouped as Megatron stores it."""
    g, per = s.num_kv_heads, s.num_heads // s.num_kv_heads
    rest = q.shape[1:]
    q = q.reshape(g, per * s.head_dim, *rest)
    k = k.reshape(g, s.head_dim, *rest)
    v = v.reshape(g, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_to_hf(qkv: Tensor, s: Shape) -> tuple[Tensor, Tensor, Tensor]:
    g, per, d = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, Tensor], s: Shape) -> dict[str, Tensor]:
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not s.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    attn_norm, mlp_norm = _norm_names(s)
    for i in range(s.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], s)
        if a + "q_proj.bias" in hf:  # Qwen2
            out[m + "self_attention.linear_qkv.bias"] = _qkv_to_megatron(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], s)
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"]
        if s.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        if s.num_experts:  # gate_up_proj[e] is already [gate; up], as linear_fc1 holds it
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
            for e in range(s.num_experts):
                out[_expert(m, e) + "linear_fc1.weight"] = gate_up[e]
                out[_expert(m, e) + "linear_fc2.weight"] = down[e]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"],
                                                          hf[h + "mlp.up_proj.weight"]])
            out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
        out[m + attn_norm] = hf[h + "input_layernorm.weight"]
        out[m + mlp_norm] = hf[h + "post_attention_layernorm.weight"]
    return out


def megatron_to_hf(mc: dict[str, Tensor], s: Shape) -> dict[str, Tensor]:
    """The HF state dict, names in HF's order: embedding, each layer as its modules register, norm, lm_head."""
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"]}
    for i in range(s.num_layers):
        out |= _layer_to_hf(mc, s, f"decoder.layers.{i}.", f"model.layers.{i}.")
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = mc["embedding.word_embeddings.weight" if s.tied else "output_layer.weight"]
    return out


def _layer_to_hf(mc: dict[str, Tensor], s: Shape, m: str, h: str) -> dict[str, Tensor]:
    """One decoder layer: attention (q, k, v each with its bias, o, the q/k norms), MLP (dense: gate, up, down;
    MoE: experts.gate_up_proj, experts.down_proj, then the router gate), then the two norms."""
    a, out = h + "self_attn.", {}
    q, k, v = _qkv_to_hf(mc[m + "self_attention.linear_qkv.weight"], s)
    biases = _qkv_to_hf(mc[m + "self_attention.linear_qkv.bias"], s) \
        if m + "self_attention.linear_qkv.bias" in mc else None
    for index, proj in enumerate("qkv"):
        out[a + f"{proj}_proj.weight"] = (q, k, v)[index]
        if biases:
            out[a + f"{proj}_proj.bias"] = biases[index]
    out[a + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
    if s.qk_norm:
        out[a + "q_norm.weight"] = mc[m + "self_attention.q_layernorm.weight"]
        out[a + "k_norm.weight"] = mc[m + "self_attention.k_layernorm.weight"]
    if s.num_experts:
        experts = range(s.num_experts)
        out[h + "mlp.experts.gate_up_proj"] = torch.stack([mc[_expert(m, e) + "linear_fc1.weight"] for e in experts])
        out[h + "mlp.experts.down_proj"] = torch.stack([mc[_expert(m, e) + "linear_fc2.weight"] for e in experts])
        out[h + "mlp.gate.weight"] = mc[m + "mlp.router.weight"]
    else:
        gate, up = torch.chunk(mc[m + "mlp.linear_fc1.weight"], 2)
        out |= {h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                h + "mlp.down_proj.weight": mc[m + "mlp.linear_fc2.weight"]}
    attn_norm, mlp_norm = _norm_names(s)
    out[h + "input_layernorm.weight"] = mc[m + attn_norm]
    out[h + "post_attention_layernorm.weight"] = mc[m + mlp_norm]
    return out


# ---- tensor, pipeline and expert parallel shards -----------------------------------------------

EXPERT = re.compile(r"^(.+\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$")


def is_expert(name: str) -> bool:
    """A Megatron name of one expert's weight: split over EP ranks, whole on each TP rank (the router is not)."""
    return EXPERT.match(name) is not None


def _kind(name: str) -> str:
    if is_expert(name):  # whole experts on every TP rank (expert_tensor_parallel_size 1)
        return "replicated"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "replicated"


def tp_split(mc: dict[str, Tensor], s: Shape, tp: int) -> list[dict[str, Tensor]]:
    """The full Megatron state -> one state per tensor-parallel rank."""
    if s.num_kv_heads % tp:
        raise ValueError(f"{s.num_kv_heads} key/value groups do not split over tensor_model_parallel_size {tp}")
    if s.vocab_size % tp:  # Megatron-LM pads the vocabulary; the HF embedding here is taken as it is
        raise ValueError(f"a vocabulary of {s.vocab_size} does not split over tensor_model_parallel_size {tp}")
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, t in mc.items():
        kind = _kind(name)
        if kind == "qkv":  # whole groups per rank
            parts = [p.reshape(-1, *t.shape[1:]) for p in t.reshape(s.num_kv_heads, -1, *t.shape[1:]).chunk(tp)]
        elif kind == "fc1":
            gate, up = t.chunk(2)
            parts = [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))]
        elif kind == "rows":
            parts = list(t.chunk(tp))
        elif kind == "cols":
            parts = list(t.chunk(tp, dim=1))
        else:
            parts = [t] * tp
        for shard, part in zip(shards, parts):
            shard[name] = part.contiguous()
    return shards


def tp_merge(shards: list[dict[str, Tensor]], s: Shape) -> dict[str, Tensor]:
    """The inverse of tp_split."""
    out = {}
    for name in shards[0]:
        parts = [shard[name] for shard in shards]
        kind = _kind(name)
        if kind == "fc1":
            gates, ups = zip(*(p.chunk(2) for p in parts))
            out[name] = torch.cat([*gates, *ups])
        elif kind in ("qkv", "rows"):
            out[name] = torch.cat(parts)
        elif kind == "cols":
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = parts[0]
    return out


LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def stage_layers(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage, as megatron-core places them (num_layers_in_{first,last}_pipeline_stage): the
    first and last stages hold what they are given, the stages between them share the rest evenly."""
    fixed = {0: first, pp - 1: last} if pp > 1 else {}
    given = {stage: n for stage, n in fixed.items() if n is not None}
    rest, middle = num_layers - sum(given.values()), pp - len(given)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise ValueError(f"{num_layers} layers do not split over pipeline_model_parallel_size {pp} with "
                         f"{first} on the first stage and {last} on the last")
    return [given.get(stage, rest // middle if middle else 0) for stage in range(pp)]


def pp_split(mc: dict[str, Tensor], s: Shape, layers: list[int]) -> list[dict[str, Tensor]]:
    """One state per pipeline stage, stage i holding layers[i] consecutive layers (renumbered from 0; stage_layers),
    the embedding on the first stage, the final norm and output layer on the last (a tied model's last stage: a
    copy of the embedding, as Megatron keeps one there)."""
    starts = [sum(layers[:i]) for i in range(len(layers))]
    stages: list[dict[str, Tensor]] = [{} for _ in layers]
    for name, t in mc.items():
        if m := LAYER.match(name):
            layer = int(m.group(1))
            stage = max(i for i, start in enumerate(starts) if start <= layer and layers[i])
            stages[stage][f"decoder.layers.{layer - starts[stage]}.{m.group(2)}"] = t
        elif name.startswith("embedding."):
            stages[0][name] = t
        else:
            stages[-1][name] = t
    if s.tied and len(layers) > 1:
        stages[-1]["output_layer.weight"] = mc["embedding.word_embeddings.weight"]
    return stages


def pp_merge(stages: list[dict[str, Tensor]], s: Shape, layers: list[int]) -> dict[str, Tensor]:
    """The inverse of pp_split (a tied model's output_layer copy dropped)."""
    out = {}
    for index, stage in enumerate(stages):
        for name, t in stage.items():
            if s.tied and name == "output_layer.weight":
                continue
            m = LAYER.match(name)
            out[f"decoder.layers.{sum(layers[:index]) + int(m.group(1))}.{m.group(2)}" if m else name] = t
    return out


def ep_split(mc: dict[str, Tensor], s: Shape, ep: int) -> list[dict[str, Tensor]]:
    """One state per expert-parallel rank: rank r holds each layer's experts r·E/ep .. (r+1)·E/ep - 1,
    renumbered from 0, and every non-expert tensor (router, attention, norms, embeddings)."""
    if s.num_experts % ep:
        raise ValueError(f"{s.num_experts} experts do not split over expert_model_parallel_size {ep}")
    per = s.num_experts // ep
    states: list[dict[str, Tensor]] = [{} for _ in range(ep)]
    for name, t in mc.items():
        if m := EXPERT.match(name):
            e = int(m.group(2))
            states[e // per][f"{m.group(1)}{e % per}.{m.group(3)}"] = t
        else:
            for state in states:
                state[name] = t
    return states


def ep_merge(states: list[dict[str, Tensor]], s: Shape) -> dict[str, Tensor]:
    """The inverse of ep_split: experts numbered back to global, in rank order where rank 0's stood;
    every other tensor from rank 0."""
    per = s.num_experts // len(states)
    experts: dict[str, dict[str, Tensor]] = {}  # per layer prefix, its global experts in rank order
    for rank, state in enumerate(states):
        for name, t in state.items():
            if m := EXPERT.match(name):
                experts.setdefault(m.group(1), {})[f"{m.group(1)}{rank * per + int(m.group(2))}.{m.group(3)}"] = t
    out = {}
    for name, t in states[0].items():
        if m := EXPERT.match(name):
            out |= experts.pop(m.group(1), {})
        else:
            out[name] = t
    return out

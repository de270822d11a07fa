"""Load the policy and its tokenizer: a Hugging Face id, a local path, or the tiny local model.

Only trainer and rollout import this module (it imports torch and transformers).
"tiny" builds a small Llama-, Qwen2-, Qwen3- or Qwen3-MoE-style model with random weights and a
character-level tokenizer, entirely offline: tests and the default local run use it.
Any other name goes through `AutoModelForCausalLM.from_pretrained`, the same code a
real checkpoint takes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

from services.common.config import PolicyConfig
from services.common.tokenizing import (PASSTHROUGH_TEMPLATE, TINY_CHARS, TINY_CHAT_TEMPLATE,  # noqa: F401 (re-exported)
                                        TINY_SPECIALS, build_tiny_tokenizer, load_tokenizer, with_chat_template)

log = logging.getLogger("flywheel.modeling")


def model_config(cfg: PolicyConfig, vocab_size: int) -> PretrainedConfig:
    """The policy's Hugging Face config, the tiny model's or the checkpoint's, with policy.hf_config_overrides
    applied: the trainer and both rollout engines build the model from it."""
    if cfg.model_name == "tiny":
        shape = cfg.tiny
        config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                      "qwen3_moe": Qwen3MoeConfig}[shape.architecture]
        experts = {} if shape.architecture != "qwen3_moe" else dict(
            num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
        config = config_cls(
            vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_attention_heads, tie_word_embeddings=False,
            max_position_embeddings=max(256, cfg.max_total_sequence_length), pad_token_id=0, bos_token_id=1,
            eos_token_id=2, head_dim=shape.hidden_size // shape.num_attention_heads,  # Qwen3 would default to 128
            **experts)
    else:
        config = AutoConfig.from_pretrained(cfg.model_name)
    apply_overrides(config, cfg.hf_config_overrides)
    return config


def apply_overrides(config: PretrainedConfig, overrides: dict[str, Any], where: str = "policy.hf_config_overrides"
                    ) -> None:
    """Set each attribute in place; a nested config (text_config, ...) takes a dict of its own, which updates it
    rather than replacing it, as vLLM's hf_overrides does. An attribute the config lacks is set anyway (NeMo RL
    and vLLM allow that) with a warning, since a misspelt one would otherwise change nothing unseen."""
    for key, value in overrides.items():
        current = getattr(config, key, _MISSING)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            apply_overrides(current, value, f"{where}.{key}")
            continue
        if current is _MISSING:
            log.warning("%s.%s: %s has no such attribute; setting it anyway", where, key, type(config).__name__)
        setattr(config, key, value)


_MISSING = object()


def build_tiny_model(cfg: PolicyConfig, vocab_size: int, seed: int) -> PreTrainedModel:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(cfg, vocab_size), dtype=torch.float32)
    return model


def check_vocab(rows: int, tokenizer, cfg: PolicyConfig) -> None:
    """A tokenizer with ids past the embedding's rows (another model's, policy.tokenizer.name) would index out of
    range in the first forward; say so at load instead."""
    if len(tokenizer) > rows:
        raise ValueError(f"tokenizer {cfg.tokenizer_name!r} has {len(tokenizer)} tokens, more than "
                         f"the {rows} embedding rows of {cfg.model_name!r}")


def load_policy(cfg: PolicyConfig, seed: int, device: str | torch.device = "cpu"):
    """(model, tokenizer) in train mode off; dtype from `cfg.precision`."""
    tokenizer = load_tokenizer(cfg)
    dtype = getattr(torch, cfg.precision)
    if cfg.model_name == "tiny":
        model = build_tiny_model(cfg, len(tokenizer), seed).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.model_name, config=model_config(cfg, len(tokenizer)),
                                                     dtype=dtype)
        check_vocab(model.get_input_embeddings().num_embeddings, tokenizer, cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk: int | None = None) -> torch.Tensor:
    """logprob of each token under softmax(logits / T). logits [B,T,V], tokens [B,T] -> [B,T] float32.

    Rollout and trainer both score with this one function, so the engine/trainer
    mismatch metrics measure numerics, not two definitions. `chunk` positions at a time
    (policy.logprob_chunk_size; None: all at once), in float32 whatever the logits' dtype.
    """
    return _TokenLogprobs.apply(logits, tokens, temperature, chunk or max(tokens.shape[1], 1))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T) gathered at `tokens`, one chunk of positions at a time.

    The plain `log_softmax(logits.float() / T).gather(...)` holds three float32 copies of
    [B, T, V] at its peak and keeps one for backward: 4.7 GB each for one 8k-token row of a
    152k vocabulary. Here forward and backward each hold one chunk's float32 [B, chunk, V],
    and backward keeps only the logits (which the model made anyway) and the [B, T]
    log-normaliser, recomputing each chunk's softmax:

        out_t            = x_t[tok_t] - logsumexp(x_t),  x_t = logits_t / T
        d out_t / d x_t  = onehot(tok_t) - softmax(x_t)
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        out = logits.new_empty(tokens.shape, dtype=torch.float32)
        normaliser = torch.empty_like(out)
        for s in range(0, tokens.shape[1], chunk):
            x = logits[:, s:s + chunk].float() / temperature
            normaliser[:, s:s + chunk] = torch.logsumexp(x, dim=-1)
            out[:, s:s + chunk] = x.gather(-1, tokens[:, s:s + chunk, None]).squeeze(-1) - normaliser[:, s:s + chunk]
        ctx.save_for_backward(logits, tokens, normaliser)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, tokens, normaliser = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for s in range(0, tokens.shape[1], ctx.chunk):
            x = logits[:, s:s + ctx.chunk].float() / ctx.temperature
            g = grad[:, s:s + ctx.chunk, None].float()
            d = (x - normaliser[:, s:s + ctx.chunk, None]).exp_().mul_(-g)  # -softmax * g
            d.scatter_add_(-1, tokens[:, s:s + ctx.chunk, None], g)  # + onehot * g
            grad_logits[:, s:s + ctx.chunk] = d.div_(ctx.temperature)
        return grad_logits, None, None, None

"""The GPU check's model shapes, as `flywheel` config overrides: built from a config, never downloaded."""

from __future__ import annotations

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864,
                 num_key_value_heads=2, vocab_size=151936, tied=True)
"""Qwen2-0.5B's shape (its config.json): ~494M parameters, embeddings tied to the output layer."""
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            num_key_value_heads=1, vocab_size=1024, tied=True)
"""The same structure (grouped-query attention, tied, qwen2 biases) small enough for the CPU dry run."""


def overrides(shape: dict, *, tied: bool | None = None) -> list[str]:
    """policy.* overrides that build `shape` as a "tiny" qwen2 model (services/common/modeling.py)."""
    s = dict(shape, **({} if tied is None else {"tied": tied}))
    hf = (f"{{num_key_value_heads: {s['num_key_value_heads']}, vocab_size: {s['vocab_size']}, "
          f"tie_word_embeddings: {str(s['tied']).lower()}}}")
    return ["policy.model_name=tiny", "policy.tiny.architecture=qwen2",
            *(f"policy.tiny.{k}={s[k]}" for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                  "intermediate_size")),
            f"policy.hf_config_overrides={hf}"]

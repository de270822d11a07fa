"""LoRA (policy.lora_cfg): which layers get adapters, what rollout receives, what the reference policy is,
and that a step trains only the adapters. 2-rank FSDP2, export and resume with LoRA are in test_fsdp2_ranks.py,
test_export.py and test_resume.py."""

import pytest
import torch
from trainer_harness import config, run_ranks, step_batch

from services.common.config import LoRAConfig
from services.common.modeling import load_policy
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed
from services.trainer.lora import LoRALinear, adapters_off, apply_lora, merge_lora

TEXT = "1+2=3 and 4*5=20"


def _adapted(lora: LoRAConfig, *overrides: str):
    """(tiny model with adapters whose B is random, so the update is not zero; tokenizer)."""
    cfg = config(*overrides)
    model, tokenizer = load_policy(cfg.policy, seed=1)
    apply_lora(model, lora, seed=1)
    g = torch.Generator().manual_seed(1)  # its own: the global generator's state depends on the tests run before
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(std=0.05, generator=g)
    return model, tokenizer, cfg


def _logits(model, tokenizer):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokenizer.encode(TEXT)])).logits


def test_the_merged_weights_rollout_receives_give_the_adapted_models_logits():
    lora = LoRAConfig(enabled=True, match_all_linear=True, dim=4, alpha=8)
    model, tokenizer, cfg = _adapted(lora)
    merged = merge_lora(model.state_dict(), lora.scale)
    plain, _ = load_policy(cfg.policy, seed=7)  # other weights: all must come from `merged`
    plain.load_state_dict(merged)  # strict: the Hugging Face names exactly, no adapter left over
    torch.testing.assert_close(_logits(plain, tokenizer), _logits(model, tokenizer), rtol=0, atol=1e-5)
    base, _ = load_policy(cfg.policy, seed=1)
    assert (_logits(plain, tokenizer) - _logits(base, tokenizer)).abs().max() > 1e-2


def test_with_adapters_off_the_model_is_the_base_model():
    model, tokenizer, cfg = _adapted(LoRAConfig(enabled=True))
    base, _ = load_policy(cfg.policy, seed=1)
    with adapters_off(model):
        assert torch.equal(_logits(model, tokenizer), _logits(base, tokenizer))
    assert not torch.equal(_logits(model, tokenizer), _logits(base, tokenizer))


LAYER_0 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("selection, expected", [
    ({}, [f"model.layers.{i}.{part}.{n}" for i in (0, 1) for part, n in
          [("self_attn", n) for n in LAYER_0[:4]] + [("mlp", n) for n in LAYER_0[4:]]]),  # "*_proj"
    ({"match_all_linear": True}, "all 14 projections and lm_head"),
    ({"target_modules": ["q_proj", "*.layers.1.mlp.up_proj"]},
     ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj"]),
    ({"exclude_modules": ["*_proj"]}, ["lm_head"]),
], ids=["default", "match_all_linear", "target_modules", "exclude_modules"])
def test_layers_are_chosen_by_automodels_rules(selection, expected):
    model, _ = load_policy(config().policy, seed=1)
    names = apply_lora(model, LoRAConfig(enabled=True, **selection), seed=1)
    if selection.get("match_all_linear"):
        assert len(names) == 15 and names[-1] == "lm_head"
    else:
        assert sorted(names) == sorted(expected)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}


def test_a_tied_lm_head_gets_no_adapter():
    """Its weight is the embedding's; the published weights hold it once, so a merged update would move both."""
    model, _ = load_policy(config("policy.hf_config_overrides={tie_word_embeddings: true}").policy, seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = apply_lora(model, LoRAConfig(enabled=True, match_all_linear=True), seed=1)
    assert "lm_head" not in names and len(names) == 14


def test_a_pattern_that_matches_nothing_is_an_error():
    model, _ = load_policy(config().policy, seed=1)
    with pytest.raises(ValueError, match="matched no linear layer"):
        apply_lora(model, LoRAConfig(enabled=True, target_modules=["qkv"]), seed=1)


def _lora_step(rank: int, out: str) -> None:
    lora = ["policy.lora_cfg.enabled=true", "loss_fn.reference_policy_kl_penalty=0.1"]
    backend = FSDP2Backend(config(*lora), init_distributed(120))
    initial = {k: v.clone() for k, v in backend.model.state_dict().items()}
    batch, advantages = step_batch(backend.cfg)
    lengths = batch.attention_mask.sum(1).tolist()
    for _ in range(2):
        metrics = backend.train_step(batch, advantages)
    plain = FSDP2Backend(config("loss_fn.reference_policy_kl_penalty=0.1"), init_distributed(120))
    torch.save({"initial": initial, "after": backend.model.state_dict(), "metrics": metrics,
                "optimized": sum(len(g["params"]) for g in backend.optimizer.param_groups),
                "reference": backend._reference_logprobs(batch, lengths),
                "policy": backend._all_logprobs(backend.model, batch, lengths),
                "base_reference": plain._reference_logprobs(batch, lengths)}, out)


def test_a_lora_step_moves_only_the_adapters_and_its_reference_is_the_base_model(tmp_path):
    out = str(tmp_path / "lora.pt")
    run_ranks(1, _lora_step, out)
    r = torch.load(out)
    adapters = {k for k in r["initial"] if ".lora_" in k}
    assert r["optimized"] == len(adapters) == 28  # A and B of the 14 "*_proj" layers
    for name, before in r["initial"].items():
        moved = not torch.equal(r["after"][name], before)
        assert moved == (name in adapters), name  # A moves too: B is no longer zero on the second step
    assert r["metrics"]["kl_penalty"] > 0  # the second step's policy is off the base
    assert torch.equal(r["reference"], r["base_reference"])  # the frozen copy a full-weight run keeps
    assert not torch.equal(r["policy"], r["reference"])

import logging

import pytest
import torch
from transformers import LlamaConfig

from services.common.config import PolicyConfig
from services.common.modeling import apply_overrides, load_policy


def test_a_local_checkpoint_loads_through_the_same_code_as_a_hub_id(tmp_path):
    tiny, tokenizer = load_policy(PolicyConfig(), seed=7)
    tiny.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    model, loaded_tokenizer = load_policy(PolicyConfig(model_name=str(tmp_path)), seed=0)

    expected = tiny.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    messages = [{"role": "user", "content": "copy 3"}]
    assert (loaded_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_the_tiny_model_is_the_same_for_the_same_seed():
    a, _ = load_policy(PolicyConfig(), seed=3)
    b, _ = load_policy(PolicyConfig(), seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_hf_config_overrides_reach_a_local_checkpoints_config_and_the_tiny_models(tmp_path):
    tiny, tokenizer = load_policy(PolicyConfig(), seed=7)
    tiny.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    overrides = {"max_position_embeddings": 1234, "rms_norm_eps": 1e-3}
    model, _ = load_policy(PolicyConfig(model_name=str(tmp_path), hf_config_overrides=overrides), seed=0)
    assert (model.config.max_position_embeddings, model.config.rms_norm_eps) == (1234, 1e-3)
    assert torch.equal(model.state_dict()["lm_head.weight"], tiny.state_dict()["lm_head.weight"])  # weights kept
    shaped, _ = load_policy(PolicyConfig(hf_config_overrides={"intermediate_size": 40}), seed=0)
    assert shaped.model.layers[0].mlp.up_proj.weight.shape[0] == 40


def test_a_nested_config_is_updated_in_place_and_an_unknown_attribute_is_set_with_a_warning(caplog):
    config = LlamaConfig(hidden_size=64)
    config.text_config = LlamaConfig(hidden_size=64, rms_norm_eps=1e-6)
    with caplog.at_level(logging.WARNING, logger="flywheel.modeling"):
        apply_overrides(config, {"text_config": {"rms_norm_eps": 1e-5}, "not_an_attribute": 3})
    assert config.text_config.rms_norm_eps == 1e-5 and config.text_config.hidden_size == 64
    assert config.not_an_attribute == 3
    assert "policy.hf_config_overrides.not_an_attribute" in caplog.text


def test_a_separate_tokenizer_is_loaded_and_one_with_more_tokens_than_the_embedding_is_refused(tmp_path):
    """policy.tokenizer.name, as NeMo RL's Nemotron base-model recipes name the instruct model's tokenizer."""
    tiny, tokenizer = load_policy(PolicyConfig(), seed=7)
    tiny.save_pretrained(tmp_path / "model")
    tokenizer.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    cfg = PolicyConfig(model_name=str(tmp_path / "model"), tokenizer={"name": str(tmp_path / "tokenizer")})
    _, loaded = load_policy(cfg, seed=0)
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "<<x>>"

    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(tmp_path / "bigger")
    bigger = PolicyConfig(model_name=str(tmp_path / "model"), tokenizer={"name": str(tmp_path / "bigger")})
    with pytest.raises(ValueError, match=r"has \d+ tokens, more than the \d+ embedding rows"):
        load_policy(bigger, seed=0)

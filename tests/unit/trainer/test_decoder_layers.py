"""FSDP2 finds a model's decoder layers by its `_no_split_modules`, not by a Llama-shaped attribute path."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from services.trainer.backends.fsdp2 import decoder_layers


def test_qwen2_layers_are_its_model_layers():
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert decoder_layers(model) == list(model.model.layers)


def test_a_model_that_keeps_its_blocks_elsewhere_is_found_too():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2))
    assert decoder_layers(model) == list(model.transformer.h)  # no model.model.layers here


def test_a_model_naming_no_layer_class_is_refused_by_name():
    with pytest.raises(ValueError, match="Sequential names no decoder layer class"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))

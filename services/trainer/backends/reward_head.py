"""The reward model's trainer side (rm:): a sequence-classification model with one label, and its scores.

A Bradley-Terry reward model is the policy's architecture with a scalar head
(`AutoModelForSequenceClassification`, num_labels 1), as NeMo RL's rm.py loads it and as
`flywheel serve reward_model` (services/rollout/reward_model.py) serves it: the score of a row is the head's
output at its last real token (Hugging Face finds it by config.pad_token_id; rows are right-padded).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification

from services.common.config import PolicyConfig
from services.common.modeling import load_tokenizer, model_config
from services.trainer.batch import TrainBatch
from services.trainer.plan import padded_width


def load_scorer(cfg: PolicyConfig, seed: int, device: str | torch.device = "cpu"):
    """(model, tokenizer): policy.model_name with a fresh scalar head (the tiny model: random, seeded)."""
    tokenizer = load_tokenizer(cfg)
    config = model_config(cfg, len(tokenizer))
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if cfg.model_name == "tiny":
            model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, config=config,
                                                                       dtype=torch.float32)
    model.config.architectures = [type(model).__name__]  # the checkpoint's hf/config.json: export picks the class by it
    return model.to(device), tokenizer


def scores(model: torch.nn.Module, b: TrainBatch, rows: list[int], device: torch.device) -> Tensor:
    """[len(rows)] the head's score of each row's whole sequence."""
    width = padded_width(b.attention_mask[rows].sum(1).tolist())
    ids, mask = b.input_ids[rows, :width].to(device), b.attention_mask[rows, :width].to(device)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()

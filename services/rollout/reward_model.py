"""`flywheel serve reward_model`: NeMo RL's reward-model environment (env.reward_model), behind EnvironmentService.Step.

    rollout ──Step(env_name=reward_model)──▶ environment service ──Step (run token)──▶ this server
        each episode's whole conversation ──the reward model's chat template──▶ one forward ──▶ its score = reward

A Bradley-Terry reward model is a Hugging Face sequence-classification model with one label: the logit at the
last real token of the conversation is the reward. Every episode ends with that turn, as in NeMo RL. It lives
with rollout because it is a model on an accelerator (the environment service never imports torch); the
environment service forwards to it with its retries, deadline and circuit breaker (environment/remote.py).
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from services.common.config import PolicyConfig
from services.common.config_data import RewardModelEnvConfig
from services.common.errors import require
from services.common.modeling import build_tiny_tokenizer, model_config, with_chat_template
from services.common.pb.flywheel.v1 import environment_pb2, environment_pb2_grpc, types_pb2
from services.common.server import SerialThread, run_service
from services.common.telemetry import setup_telemetry

log = logging.getLogger("flywheel.reward_model")
ROLES = {"environment": "user"}
"""Flywheel's roles the reward model's chat template may not know, as the one it does: an observation is the
user's turn."""


def load_reward_model(cfg: RewardModelEnvConfig, seed: int = 0, device: str | torch.device = "cpu"):
    """(model, tokenizer), eval mode, in cfg.precision. "tiny": the tiny policy's shape (Llama) with one label,
    random, and the tiny tokenizer."""
    dtype = getattr(torch, cfg.precision)
    if cfg.model_name == "tiny":
        tokenizer = build_tiny_tokenizer()
        config = model_config(PolicyConfig(), len(tokenizer))
        config.num_labels = 1
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).to(dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer.name or cfg.model_name)
        model = AutoModelForSequenceClassification.from_pretrained(cfg.model_name, dtype=dtype)
        if model.config.num_labels != 1:
            raise ValueError(f"env.reward_model.model_name {cfg.model_name!r} has {model.config.num_labels} labels; "
                             f"a Bradley-Terry reward model has one (its score)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id  # the model finds each row's last real token by it
    return model.to(device).eval(), with_chat_template(tokenizer, cfg.tokenizer, cfg.tokenizer.name or cfg.model_name,
                                                    "env.reward_model.tokenizer")


class RewardModel:
    """Scores conversations, `batch_size` at a time, each cut to its last `max_model_len` tokens."""

    def __init__(self, cfg: RewardModelEnvConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tokenizer = load_reward_model(cfg, seed, self.device)

    def token_ids(self, conversation: list[dict]) -> list[int]:
        messages = [{"role": ROLES.get(m["role"], m["role"]), "content": m["content"]} for m in conversation]
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)[-self.cfg.max_model_len:]

    @torch.inference_mode()
    def score(self, conversations: list[list[dict]]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(conversations), self.cfg.batch_size):
            rows = [self.token_ids(c) for c in conversations[start:start + self.cfg.batch_size]]
            for i, row in enumerate(rows):
                require(len(row) > 0, f"episodes[{start + i}]: no tokens to score (empty messages, and the reward "
                                      f"model's chat template adds none)")
            width = max(len(r) for r in rows)
            pad = self.tokenizer.pad_token_id
            # Right padding: the model reads each row's score at its last token that is not padding.
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
            scores += self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
        return scores


class RewardModelServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    """Step only: the environment service registers, lists and generates; this server scores."""

    def __init__(self, model: RewardModel) -> None:
        self.model = model
        self.thread = SerialThread("reward-model")  # one forward at a time, off the event loop

    async def Step(self, request, context):
        require(len(request.episodes) > 0, "episodes must not be empty")
        for i, episode in enumerate(request.episodes):
            require(len(episode.messages) > 0 and episode.messages[-1].role == "assistant",
                    f"episodes[{i}]: the last message must be the assistant's response, which the reward model scores")
        conversations = [[{"role": m.role, "content": m.content} for m in e.messages] for e in request.episodes]
        scores = await self.thread.call(self.model.score, conversations)
        return environment_pb2.StepResponse(results=[environment_pb2.EpisodeResult(
            observation=types_pb2.ChatMessage(role="environment", content=f"Environment: {score}"), reward=score,
            terminated=True, answer=conversation[-1]["content"] if request.return_extracted_answer else "")
            for score, conversation in zip(scores, conversations, strict=True)])


async def serve(cfg) -> None:
    setup_telemetry("reward_model", cfg.run.name, cfg.telemetry)
    # Loaded before the port opens: the environment service's calls wait for it (wait_for_ready) meanwhile.
    model = RewardModel(cfg.env.reward_model, seed=cfg.run.seed)
    log.info("reward model %s on %s", cfg.env.reward_model.model_name, model.device)
    servicer = RewardModelServicer(model)
    await run_service("reward_model", cfg.addresses.reward_model,
                      lambda server: environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server),
                      security=cfg.security)

"""The trainer's side of a weight sync, for engine tests: policy states, a real WeightSender, the trainer's
logprobs, and NeMo RL's token_mult_prob_error; and the endpoint served on an engine at version 0."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from services.common.config import FlywheelConfig
from services.common.modeling import load_policy, token_logprobs
from services.common.weights import SyncResult, WeightSender
from services.rollout.endpoint.server import EndpointServer
from services.rollout.engines import Engine, Generated, Sampling, make_engine
from services.rollout.episodes import prompt_token_ids


SHARPEN = 40.0
PARITY = 1.05
"""NeMo RL's bar on token_mult_prob_error (grpo_topp_topk, grpo_non_colocated): at most this, the engine sampled
with the weights the trainer pushed."""


@torch.no_grad()
def policy(cfg: FlywheelConfig, seed: int) -> torch.nn.Module:
    """The trainer's model at init with `seed` (different seeds: different weights, same layout), its lm_head
    scaled up: a fresh init is nearly uniform over the vocabulary, so two seeds would sample alike."""
    model, _ = load_policy(cfg.policy, seed)
    model.lm_head.weight.mul_(SHARPEN)
    return model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the trainer sends: FSDP2Policy.full_state_dict()."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class Trainer:
    """A WeightSender on gloo that pushes versions to one engine, as the trainer does after a step."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.announced: list = []
        self.sender = WeightSender(backend="gloo", publish=self.announced.append, join_timeout_s=120)

    def start_sync(self, version: int, model: torch.nn.Module) -> tuple[threading.Thread, list[SyncResult]]:
        """Start pushing `version` on a thread; returns once it is announced (the engine may join now)."""
        results: list[SyncResult] = []
        before = len(self.announced)
        thread = threading.Thread(target=lambda: results.append(
            self.sender.sync(version, [self.worker_id], state(model), timeout_s=300)), daemon=True)
        thread.start()
        while len(self.announced) == before:
            threading.Event().wait(0.01)
        return thread, results

    async def push(self, engine: Engine, version: int, model: torch.nn.Module) -> SyncResult:
        thread, results = self.start_sync(version, model)
        digest = await engine.load_weights(self.announced[-1].fields(), timeout_s=120)
        await asyncio.to_thread(thread.join)
        assert results[0].members_ok == [self.worker_id] and digest == results[0].checksum
        return results[0]

    def close(self) -> None:
        self.sender.close()


@contextlib.asynccontextmanager
async def serving(cfg: FlywheelConfig, name: str, model: torch.nn.Module, template: str | None = None):
    """(endpoint, engine): `cfg`'s engine started, `template` as its chat template when given, `model`'s weights
    pushed as version 0 by a real WeightSender, and the OpenAI-compatible endpoint listening on a free port."""
    engine = make_engine(cfg, name)
    await engine.start()
    if template is not None:
        engine.tokenizer.chat_template = template
    trainer = Trainer(name)
    try:
        await trainer.push(engine, 0, model)
        endpoint = EndpointServer(cfg, engine, name)
        await endpoint.start()
        try:
            yield endpoint, engine
        finally:
            await endpoint.stop()
    finally:
        trainer.close()
        await engine.close()


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, prompt: list[int], out: Generated, temperature: float) -> torch.Tensor:
    """The trainer's logprobs of `out`'s tokens after `prompt` (one forward over the whole sequence)."""
    ids = torch.tensor([prompt + out.token_ids])
    logits = model(ids).logits
    return token_logprobs(logits[:, len(prompt) - 1:-1], ids[:, len(prompt):], temperature)[0]


async def sample_and_score(engine: Engine, model: torch.nn.Module, prompt: list[int], sampling,
                           n: int) -> tuple[list[Generated], torch.Tensor, torch.Tensor]:
    """`n` completions of `prompt`, with the engine's logprobs and the trainer's under `model`, each concatenated."""
    outs = await engine.generate([prompt] * n, sampling)
    gen = torch.cat([torch.tensor(o.logprobs) for o in outs])
    train = torch.cat([trainer_logprobs(model, prompt, o, sampling.temperature) for o in outs])
    return outs, gen, train


async def push_two_versions_and_check_parity(cfg: FlywheelConfig,
                                             worker_id: str) -> list[tuple[SyncResult, list[Generated]]]:
    """Start `cfg`'s engine, push two versions of the policy into it (the second reloads a loaded model) and
    sample each: the engine's logprobs must match the trainer's under the version just pushed."""
    engine = make_engine(cfg, worker_id)
    trainer = Trainer(worker_id)
    pushed = []
    try:
        await engine.start()
        prompt = prompt_token_ids(engine.tokenizer, [{"role": "user", "content": "copy 3"}])
        sampling = Sampling(max_new_tokens=12, temperature=0.8)
        for version in (0, 1):
            model = policy(cfg, seed=cfg.run.seed + version)
            result = await trainer.push(engine, version, model)
            outs, gen, train = await sample_and_score(engine, model, prompt, sampling, 4)
            assert len(gen) > 0 and token_mult_prob_error(gen, train) <= PARITY, version
            pushed.append((result, outs))
    finally:
        trainer.close()
        await engine.close()
    return pushed


def token_mult_prob_error(gen: torch.Tensor, train: torch.Tensor) -> float:
    """NeMo RL's metric: mean over tokens of exp(|gen - train|); 1.0 is exact."""
    return torch.exp((gen.double() - train.double()).abs()).mean().item()


async def until_generating(engine: Engine, requests: int) -> None:
    """Until `requests` requests are in the engine (vllm: its output processor holds them; hf: the batch on
    its thread): what a test starts next is submitted after them."""
    def busy() -> bool:
        if hasattr(engine, "llm"):
            return engine.llm.output_processor.get_num_unfinished_requests() >= requests
        return engine.running_rows >= requests

    while not busy():
        await asyncio.sleep(0.005)

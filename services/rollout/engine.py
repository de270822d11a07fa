"""Generation engines behind one interface, and the Hugging Face transformers backend.

An engine turns prompt token ids into sampled continuations with the engine's own
per-token logprobs (under softmax(logits / temperature), the definition the trainer
uses too). `backend: vllm` selects services.rollout.vllm_engine on GPU machines.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field

import torch

from services.common.config import FlywheelConfig, GenerationConfig
from services.common.modeling import load_policy, token_logprobs


@dataclass(kw_only=True, slots=True)
class Sampling:
    """Resolved sampling settings for one turn."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_strings: list[str] = field(default_factory=list)

    @classmethod
    def resolve(cls, default: GenerationConfig, override=None) -> Sampling:
        """Proto SamplingParams on top of the configured defaults (zero = default)."""
        o = override
        return cls(max_new_tokens=(o and o.max_new_tokens) or default.max_new_tokens,
                   temperature=(o and o.temperature) or default.temperature,
                   top_p=(o and o.top_p) or default.top_p,
                   top_k=(o and o.top_k) or default.top_k,
                   stop_strings=list((o and o.stop_strings) or default.stop_strings))


@dataclass(kw_only=True, slots=True)
class Generated:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    """Generated tokens, EOS included when sampled; [n]."""
    logprobs: list[float]
    """Engine logprob of each token; [n]."""
    text: str
    truncated: bool
    """Stopped by max_new_tokens rather than EOS or a stop string."""


class Engine(abc.ABC):
    """What rollout needs from a generation backend."""

    tokenizer: object

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        """One continuation per prompt (repeat a prompt G times for a group)."""

    @abc.abstractmethod
    def weight_buffers(self) -> dict[str, torch.Tensor]:
        """Named tensors the weight receiver fills in place (the trainer's manifest order)."""

    def apply_received_weights(self) -> None:
        """Called (under `lock`) after the buffers were filled; engines that stage weights load them here."""


class HFEngine(Engine):
    """transformers `generate` on CPU or one GPU; for tests, the local run and small models."""

    def __init__(self, cfg: FlywheelConfig, device: str = "cpu") -> None:
        self.model, self.tokenizer = load_policy(cfg.policy, cfg.run.seed, device)
        self.device = device
        self.max_len = cfg.policy.max_total_sequence_length
        # Weights are swapped between generate calls; the lock makes the swap atomic.
        self.lock = threading.Lock()

    def weight_buffers(self) -> dict[str, torch.Tensor]:
        return {name: t.data for name, t in self.model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        tok = self.tokenizer
        width = max(map(len, prompts))
        budget = max(0, min(sampling.max_new_tokens, self.max_len - width))
        if budget == 0:
            return [Generated(token_ids=[], logprobs=[], text="", truncated=True) for _ in prompts]
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues from the right edge
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with self.lock:
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=True,
                temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
                max_new_tokens=budget, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                stop_strings=sampling.stop_strings or None, tokenizer=tok if sampling.stop_strings else None,
                return_dict_in_generate=True, output_logits=True)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).cpu()
        logp = token_logprobs(logits, new, sampling.temperature)
        return [self._trim(new[i], logp[i], sampling, budget) for i in range(len(prompts))]

    def _trim(self, tokens: torch.Tensor, logp: torch.Tensor, sampling: Sampling, budget: int) -> Generated:
        """Cut at EOS (kept) or at the end of the first stop string (kept, as vLLM does)."""
        eos = self.tokenizer.eos_token_id
        ids = tokens.tolist()
        n = ids.index(eos) + 1 if eos in ids else len(ids)  # HF pads after EOS
        text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
        stopped = eos in ids[:n]
        for stop in sampling.stop_strings:
            if stop in text:
                stopped = True
                text = text[: text.index(stop) + len(stop)]
                n = self._tokens_covering(ids, n, text)
                break
        return Generated(token_ids=ids[:n], logprobs=logp[:n].tolist(), text=text,
                         truncated=not stopped and n >= budget)

    def _tokens_covering(self, ids: list[int], n: int, text: str) -> int:
        for k in range(1, n + 1):
            if len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(text):
                return k
        return n


def make_engine(cfg: FlywheelConfig) -> Engine:
    if cfg.policy.generation.backend == "vllm":
        from services.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    return HFEngine(cfg)

"""Generation engines behind one interface, chosen by `policy.generation.backend` with `make_engine`.

| backend | module   | how requests run                                               | weights arrive              |
|---------|----------|----------------------------------------------------------------|-----------------------------|
| `vllm`  | vllm.py  | vLLM V1 AsyncLLM: every completion is its own request, batched | inside vLLM's worker process|
|         |          | continuously with every other group's in flight                | (vllm_worker.py)            |
| `hf`    | hf.py    | transformers `generate`, one batch at a time; calls waiting    | in this process             |
|         |          | meanwhile that sample alike share the next batch               |                             |

An engine turns prompt token ids into sampled continuations with per-token logprobs under
softmax(logits / T) over the whole vocabulary (the trainer's definition, whatever top-p/top-k say), and
the policy versions that sampled them. Weights come from the trainer's weight channel: `load_weights(ann)`
joins the announced epoch and returns the checksum it acked. Without in-flight updates a load waits until
the requests in flight finish and holds new ones back; with them (`in_flight=True`, vLLM only) requests
keep their place and the tokens sampled after the swap carry the new version.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from services.common.config import FlywheelConfig, GenerationConfig


@dataclass(kw_only=True, slots=True)
class Sampling:
    """Resolved sampling settings for one turn."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a completion (kept, like EOS), besides the tokenizer's EOS."""
    seed: int | None = None
    """Per-request seed (vLLM: per completion; hf: the batch's); None: the engine's stream."""

    @classmethod
    def resolve(cls, default: GenerationConfig, override=None) -> Sampling:
        """Proto SamplingParams on top of the configured defaults (zero = default)."""
        o = override
        return cls(max_new_tokens=(o and o.max_new_tokens) or default.max_new_tokens,
                   temperature=(o and o.temperature) or default.temperature,
                   top_p=(o and o.top_p) or default.top_p,
                   top_k=(o and o.top_k) or default.top_k,
                   stop_strings=list((o and o.stop_strings) or default.stop_strings),
                   stop_token_ids=list(default.stop_token_ids or []))


@dataclass(kw_only=True, slots=True)
class Generated:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    """Generated tokens, EOS (or a stop token) included when sampled; [n]."""
    logprobs: list[float]
    """log softmax(logits / T)[token] of each token, as the engine computed it; [n]."""
    text: str
    truncated: bool
    """Stopped by max_new_tokens rather than EOS, a stop token or a stop string."""
    versions: list[int] = field(default_factory=list)
    """Policy version that sampled each token; [n]. Differs along a row only after an in-flight update."""
    first_token_s: float | None = None
    """Seconds from the engine call to this row's first sampled token (time to first token); None if unknown."""

    @property
    def version_start(self) -> int:
        return self.versions[0] if self.versions else -1

    @property
    def version_end(self) -> int:
        return self.versions[-1] if self.versions else -1


class Engine(abc.ABC):
    """What rollout needs from a generation backend. Every method is called from the worker's event loop."""

    tokenizer: Any
    version: int = -1
    """Policy version loaded now; -1 until the first sync (the engine starts from dummy or random weights)."""

    async def start(self) -> None:
        """Finish starting on the worker's event loop (before the first load or generate)."""

    @abc.abstractmethod
    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        """One continuation per prompt (repeat a prompt G times for a group). Calls may overlap."""

    @abc.abstractmethod
    async def load_weights(self, announcement: dict[str, Any], timeout_s: float) -> str:
        """Receive the announced version over the weight channel and serve it from now on; returns the
        checksum acked to the trainer. Raises what WeightReceiver.receive raises; the old weights stay."""

    async def close(self) -> None:
        """Stop the engine and free what it holds."""


def make_engine(cfg: FlywheelConfig, worker_id: str) -> Engine:
    """The one factory. `worker_id` names this worker in weight-channel epochs."""
    if cfg.policy.generation.backend == "vllm":
        from services.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(cfg, worker_id)
    from services.rollout.engines.hf import HFEngine

    return HFEngine(cfg, worker_id)

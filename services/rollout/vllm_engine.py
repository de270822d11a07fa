"""vLLM generation engine (`policy.generation.backend: vllm`), written against vLLM's V1 `LLM` API.

Importing this module does not import vllm: every vllm import happens inside `VLLMEngine.__init__`, so the
layout helpers below (and their CPU tests) work on machines without vllm. See docs/vllm.md for what was read
and what is unverified.

How it works
------------
* The engine is an in-process `vllm.LLM` (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as NeMo RL runs it), so the
  engine core, its `UniProcExecutor` and the GPU worker live in this process.
  `LLM.collective_rpc(fn, args=...)` then calls `fn(worker, *args)` directly: tensors are passed by
  reference, nothing is serialized.
* vLLM starts with `load_format="dummy"` (random weights): the real weights always come from the trainer's
  version-0 sync, as in NeMo RL.
* Logprobs: `logprobs=0` returns the sampled token's logprob, and the engine arg
  `logprobs_mode="processed_logprobs"` makes it log_softmax of the logits *after* temperature and
  top-k/top-p masking. With top_p = 1 and no top_k that is exactly log_softmax(logits / T), the trainer's
  definition (`services.common.modeling.token_logprobs`). With top_p < 1 or top_k set, vLLM renormalises
  over the kept tokens, so the two differ by design (the HF engine has the same property: its logprobs come
  from the raw logits / T).

Weights: staging buffers plus one explicit apply
------------------------------------------------
vLLM's parameters are fused and padded (qkv_proj, gate_up_proj, vocab padded to a multiple of 64), so their
names and shapes are not the trainer's HF state dict. `weight_buffers()` therefore returns *staging* tensors
with the HF names, shapes, dtypes and order (from the HF model built on the meta device, the same
construction as the trainer's), allocated once: on the CPU (pinned) for the `gloo` weight channel, on the GPU
otherwise. The receiver fills them in place; then

    engine.apply_received_weights()

pushes them into vLLM through the model's own `load_weights(iterable of (hf_name, tensor))` (which does the
fusing/sharding/padding) via `LLM.collective_rpc`, synchronises the device and resets the prefix cache, whose
KV entries were computed with the old weights.

THE HOOK: the rollout worker must call `engine.apply_received_weights()` right after a successful
`WeightReceiver.receive(announcement, into=engine.weight_buffers(), ...)`, while it still holds `engine.lock`
(in `RolloutWorker._receive`), and before it reports the version as loaded. Engines without staging (HFEngine)
have no such method; call it when present. `engine.lock` is re-entrant here, so `apply_received_weights`
takes it itself too.

Not supported here: in-flight weight updates (`LLM.generate` runs a whole batch under the lock; a mid-batch
swap needs the AsyncLLM engine), tensor/pipeline parallelism > 1, quantized models.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import torch

from services.common.config import FlywheelConfig, PolicyConfig
from services.common.modeling import build_tiny_model, load_tokenizer
from services.common.weights.manifest import Manifest, TensorSpec
from services.rollout.engine import Engine, Generated, Sampling

log = logging.getLogger("flywheel.rollout.vllm")

DEFAULT_GPU_MEMORY_UTILIZATION = 0.6
"""NeMo RL's `vllm_cfg.gpu_memory_utilization` default; leaves room for the GPU staging buffers."""
LOGPROBS_MODE = "processed_logprobs"


# -- HF layout (CPU, no vllm) -------------------------------------------------------------------------------


def meta_policy_model(policy: PolicyConfig, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """The policy as the trainer builds it (`load_policy`), on the meta device: names, shapes, dtypes only."""
    dtype = getattr(torch, policy.precision)
    with torch.device("meta"):
        if policy.model_name == "tiny":
            model = build_tiny_model(policy, vocab_size, seed).to(dtype)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(policy.model_name)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def hf_manifest(model: torch.nn.Module) -> Manifest:
    """Manifest of `model.state_dict()` in its order: what the trainer sends (`get_model_state_dict`)."""
    return Manifest(specs=tuple(TensorSpec(name=n, shape=tuple(t.shape), dtype=t.dtype)
                                for n, t in model.state_dict().items()))


def allocate_staging(manifest: Manifest, device: str | torch.device) -> dict[str, torch.Tensor]:
    """One empty tensor per manifest entry, in manifest order (pinned when on the CPU and CUDA is present)."""
    device = torch.device(device)
    pin = device.type == "cpu" and torch.cuda.is_available()
    return {s.name: torch.empty(s.shape, dtype=s.dtype, device=device, pin_memory=pin)
            for s in manifest.specs}


def staging_device(cfg: FlywheelConfig) -> str:
    """gloo moves CPU tensors; every other channel backend can write GPU memory directly."""
    return "cpu" if cfg.weight_sync.backend == "gloo" or not torch.cuda.is_available() else "cuda"


def weights_to_load(buffers: Mapping[str, torch.Tensor],
                    tied_embeddings: bool) -> list[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) pairs for vLLM's `load_weights`. A tied `lm_head.weight` is an alias that vLLM skips
    (and, per NeMo RL's notes on vLLM 0.29, asserts on when its embedding is not in the same call); it never
    loads anything, so it is dropped."""
    return [(n, t) for n, t in buffers.items() if not (tied_embeddings and n == "lm_head.weight")]


def write_model_dir(model: torch.nn.Module, tokenizer: Any, path: str) -> str:
    """config.json + tokenizer files for a model that exists only in code ("tiny"): vLLM with
    load_format="dummy" needs a config and a tokenizer, never weights."""
    config = model.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- worker-side function (runs inside vLLM's worker via collective_rpc) -------------------------------------


def _load_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """`collective_rpc` target; `worker` is vLLM's WorkerWrapperBase (or the Worker). Returns the count."""
    inner = getattr(worker, "worker", None) or worker
    model = inner.model_runner.model
    device = getattr(inner, "device", None)
    with torch.device(device) if device is not None else nullcontext():
        model.load_weights(weights=iter(weights))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(weights)


# -- output conversion (pure) -------------------------------------------------------------------------------


def to_generated(completion: Any) -> Generated:
    """vLLM CompletionOutput -> Generated. `logprobs` is one {token_id: Logprob} per generated token
    (logprobs=0: the sampled token, at least); a missing entry becomes NaN rather than a silent 0."""
    ids = list(completion.token_ids)
    steps = completion.logprobs or []
    logps = []
    for i, tok in enumerate(ids):
        entry = steps[i].get(tok) if i < len(steps) and steps[i] is not None else None
        logps.append(float(entry.logprob) if entry is not None else float("nan"))
    return Generated(token_ids=ids, logprobs=logps, text=completion.text,
                     truncated=completion.finish_reason == "length")


def sampling_kwargs(sampling: Sampling, max_tokens: int) -> dict[str, Any]:
    """SamplingParams arguments for one row (the caller repeats prompts G times, so n=1)."""
    kw: dict[str, Any] = dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                              max_tokens=max_tokens, logprobs=0, stop=list(sampling.stop_strings) or None,
                              include_stop_str_in_output=True)
    if sampling.top_k:  # leave vLLM's own "disabled" default (-1 in old releases, 0 in new ones)
        kw["top_k"] = sampling.top_k
    return kw


def _vllm_option(cfg: FlywheelConfig, name: str, default):
    """`policy.generation.vllm_cfg.<name>` when the config has it, else the default (see docs/vllm.md)."""
    section = getattr(cfg.policy.generation, "vllm_cfg", None)
    value = getattr(section, name, None) if section is not None else None
    return default if value is None else value


# -- the engine ---------------------------------------------------------------------------------------------


class VLLMEngine(Engine):
    """vllm.LLM behind the Engine interface. `llm` and `params_factory` are test seams (a fake LLM on CPU)."""

    def __init__(self, cfg: FlywheelConfig, *, llm: Any = None,
                 params_factory: Callable[..., Any] | None = None) -> None:
        self.cfg = cfg
        self.max_len = cfg.policy.max_total_sequence_length
        self.tokenizer = load_tokenizer(cfg.policy)
        # Re-entrant: the worker holds it around receive + apply, and apply takes it again.
        self.lock = threading.RLock()
        self._meta = meta_policy_model(cfg.policy, len(self.tokenizer), cfg.run.seed)
        self.manifest = hf_manifest(self._meta)
        self.tied_embeddings = bool(getattr(self._meta.config, "tie_word_embeddings", False))
        self._staging: dict[str, torch.Tensor] | None = None
        self._model_dir: str | None = None
        if llm is None:
            llm, params_factory = self._build_llm()
        self.llm = llm
        self._params = params_factory or (lambda **kw: kw)

    def _build_llm(self):
        # In-process engine core: collective_rpc calls our function on the worker with live tensors.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s overridden to 0: the weight apply needs the "
                        "in-process engine", os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams

        p = self.cfg.policy
        model = p.model_name
        if model == "tiny":
            self._model_dir = write_model_dir(self._meta, self.tokenizer,
                                              tempfile.mkdtemp(prefix="flywheel-vllm-"))
            model = self._model_dir
        llm = LLM(model=model, tokenizer=model, dtype=p.precision, load_format="dummy",
                  seed=self.cfg.run.seed, max_model_len=p.max_total_sequence_length,
                  logprobs_mode=LOGPROBS_MODE,
                  gpu_memory_utilization=_vllm_option(self.cfg, "gpu_memory_utilization",
                                                      DEFAULT_GPU_MEMORY_UTILIZATION),
                  enforce_eager=_vllm_option(self.cfg, "enforce_eager", False),
                  tensor_parallel_size=1, enable_prefix_caching=True)
        return llm, SamplingParams

    # -- weights --

    def weight_buffers(self) -> dict[str, torch.Tensor]:
        """HF-named staging tensors (trainer's manifest order), allocated on first use, after vLLM took its
        share of GPU memory; the same dict on every call."""
        if self._staging is None:
            self._staging = allocate_staging(self.manifest, staging_device(self.cfg))
        return self._staging

    def apply_received_weights(self) -> None:
        """Load the staging tensors into vLLM's (fused) parameters and drop the now-stale prefix cache."""
        if self._staging is None:
            raise RuntimeError("apply_received_weights before weight_buffers(): nothing was received")
        with self.lock:
            pairs = weights_to_load(self._staging, self.tied_embeddings)
            self.llm.collective_rpc(_load_on_worker, args=(pairs,))
            if not self.llm.reset_prefix_cache():
                log.warning("vLLM refused to reset the prefix cache (requests running?)")

    # -- generation --

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        results: list[Generated | None] = [None] * len(prompts)
        rows, params = [], []
        for i, p in enumerate(prompts):
            budget = max(0, min(sampling.max_new_tokens, self.max_len - len(p)))
            if budget == 0:  # no room left: same answer as HFEngine
                results[i] = Generated(token_ids=[], logprobs=[], text="", truncated=True)
                continue
            rows.append(i)
            params.append(self._params(**sampling_kwargs(sampling, budget)))
        if rows:
            with self.lock:
                outs = self.llm.generate([{"prompt_token_ids": list(prompts[i])} for i in rows], params,
                                         use_tqdm=False)
            for i, out in zip(rows, outs, strict=True):
                results[i] = to_generated(out.outputs[0])
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._model_dir:
            shutil.rmtree(self._model_dir, ignore_errors=True)
            self._model_dir = None

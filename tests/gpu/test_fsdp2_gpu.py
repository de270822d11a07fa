"""Stage `fsdp2`: one FSDP2 step in bf16 on a Qwen2-0.5B-shaped random model, on one GPU (one NCCL rank).

Activation checkpointing on, Adam's moments in bfloat16 (policy.optimizer.moments_dtype) and in host memory
during a second step's logprob forwards (policy.offload_optimizer_for_logprob), the reference policy
offloaded to host memory (the backend does that on CUDA when the KL penalty asks for a reference), and `full_state_dict` checked against the manifest the rollout side
derives without any weights (`hf_manifest` of the meta-device model, what the vLLM engine announces against):
same names, order, shapes and dtypes, so the first sync's digest matches. A second check steps with
policy.cpu_offload (FSDP2's CPUOffloadPolicy: gradients and the optimizer on the host, the group NCCL).
"""

from __future__ import annotations

import gc
import math
import os
import time

import pytest

from gpu_env import DEVICE, need_device
from shapes import QWEN2_05B, TINY, overrides

pytestmark = pytest.mark.gpu

SHAPE = {"0.5b": QWEN2_05B, "tiny": TINY}[os.environ.get("FLYWHEEL_GPU_CHECK_SHAPE",
                                                          "0.5b" if DEVICE == "cuda" else "tiny")]
"""FLYWHEEL_GPU_CHECK_SHAPE=0.5b: the CPU dry run steps the full shape (minutes, ~10 GB of memory)."""


def _config(*extra: str):
    from trainer_harness import config

    return config(*overrides(SHAPE), "policy.precision=bfloat16", "policy.activation_checkpointing=true",
                  "policy.max_total_sequence_length=256", f"trainer.device={DEVICE}", *extra)


def _backend(cfg):
    from services.trainer.backends.fsdp2 import FSDP2Backend
    from services.trainer.distributed import init_distributed, trainer_device

    return FSDP2Backend(cfg, init_distributed(600, trainer_device(cfg)))


def _local(t):
    """A parameter's own storage: the local shard of a DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _step(backend, cfg, figures: dict) -> dict:
    import torch

    from trainer_harness import step_batch

    batch, advantages = step_batch(cfg)
    start = time.perf_counter()
    metrics = backend.train_step(batch, advantages)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    figures["step_s"] = round(time.perf_counter() - start, 3)
    figures["metrics"] = {k: metrics[k] for k in ("loss", "grad_norm", "lr") if k in metrics}
    finite = math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert finite and metrics["grad_norm"] > 0, metrics
    return metrics


def _check_published(backend, cfg, before, figures: dict) -> None:
    import torch

    from services.common.weights import Manifest
    from services.rollout.engines.vllm import hf_manifest, meta_policy_model

    start = time.perf_counter()
    state = backend.full_state_dict()
    figures["full_state_dict_s"] = round(time.perf_counter() - start, 3)
    published = Manifest.of(state)
    rollout = hf_manifest(meta_policy_model(cfg.policy, len(backend.tokenizer), cfg.run.seed))
    figures["published_bytes"] = published.nbytes
    assert [s.name for s in published.specs] == [s.name for s in rollout.specs]
    assert published.digest == rollout.digest, [
        (a, b) for a, b in zip(published.specs, rollout.specs) if a != b][:5]
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    if SHAPE["tied"]:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(state[name].float().cpu(), before), f"{name} did not change in the step"


def _peak(figures: dict) -> None:
    import torch

    if torch.cuda.is_available():
        figures["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def _free(backend) -> None:
    import torch

    del backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def test_fsdp2_bf16_step_with_checkpointing_and_offloaded_reference_publishes_the_rollout_manifest(figures):
    import torch

    device = need_device()
    cfg = _config("loss_fn.reference_policy_kl_penalty=0.01", "policy.optimizer.moments_dtype=bfloat16",
                  "policy.offload_optimizer_for_logprob=true")
    start = time.perf_counter()
    backend = _backend(cfg)
    figures["build_s"] = round(time.perf_counter() - start, 1)
    figures["params"] = sum(p.numel() for p in backend.model.parameters())
    assert backend.model.is_gradient_checkpointing, "policy.activation_checkpointing did not reach the model"
    assert backend.reference is not None, "reference_policy_kl_penalty > 0 built no reference model"
    if device == "cuda":
        ref = {_local(p).device.type for p in backend.reference.parameters()}
        policy = {_local(p).device.type for p in backend.model.parameters()}
        assert ref == {"cpu"} and policy == {"cuda"}, (ref, policy)
    before = backend.full_state_dict()["model.layers.0.mlp.down_proj.weight"].float().cpu()
    metrics = _step(backend, cfg, figures)
    moments = {(_local(t).dtype, _local(t).device.type) for state in backend.optimizer.state.values()
               for key, t in state.items() if key.startswith("exp_avg")}
    assert moments == {(torch.bfloat16, device)}, moments  # NeMo RL's FusedAdam exp_avg_dtype bfloat16
    figures["kl_penalty"] = metrics["kl_penalty"]
    assert math.isfinite(metrics["kl_penalty"]), metrics
    _check_published(backend, cfg, before, figures)
    _peak(figures)
    _second_step_offloads_the_optimizer_for_the_reference_forward(backend, cfg, device, figures)
    _free(backend)


def _second_step_offloads_the_optimizer_for_the_reference_forward(backend, cfg, device: str, figures: dict) -> None:
    """policy.offload_optimizer_for_logprob: with the state built by the first step, the second step's reference
    forward runs with every state tensor in host memory, and the step finds them back on the GPU. No gradient
    outlives its step (freed after the optimizer steps), so the reference forward holds neither."""
    import torch

    def state_devices() -> set[str]:
        return {_local(t).device.type for state in backend.optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0}  # Adam's step count lives on the host anyway

    cuda = device == "cuda"
    allocated = (lambda: torch.cuda.memory_allocated() / 2**30) if cuda else (lambda: 0.0)
    assert all(p.grad is None for p in backend.model.parameters()), "a gradient outlived the first step"
    seen: list[tuple[set[str], float]] = []
    hook = backend.reference.register_forward_pre_hook(lambda *_: seen.append((state_devices(), allocated())))
    between = allocated()
    second: dict = {}
    try:
        _step(backend, cfg, second)
    finally:
        hook.remove()
    assert seen and all(devices == {"cpu"} for devices, _ in seen), seen
    assert state_devices() == {device}, state_devices()
    figures["second_step"] = {"step_s": second["step_s"], "allocated_gib_between_steps": round(between, 2),
                              "allocated_gib_in_reference_forward": round(min(a for _, a in seen), 2)}


def test_fsdp2_cpu_offload_step_on_gpu_publishes_the_rollout_manifest(figures):
    device = need_device()
    cfg = _config("policy.cpu_offload=true")
    backend = _backend(cfg)
    if device == "cuda":
        assert {_local(p).device.type for p in backend.model.parameters()} == {"cpu"}
    before = backend.full_state_dict()["model.layers.0.mlp.down_proj.weight"].float().cpu()
    _step(backend, cfg, figures)
    _check_published(backend, cfg, before, figures)
    _peak(figures)
    _free(backend)

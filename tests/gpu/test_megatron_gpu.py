"""Stage `megatron`: the Megatron-Core backend at TP = PP = 1 on one GPU, on a tied and an untied qwen2 model.

For each: the GPTModel's logits against the Hugging Face model it was converted from (same random weights,
float32, so the conversion is what is compared), one training step, `full_state_dict` against the rollout's
manifest, and a checkpoint: saved into a fresh step directory as the trainer does (checkpoint.py), then
loaded back after a second step has moved the weights. Under bfloat16: the chunked logprobs, and a step. Sequence
masking (grpo.seq_logprob_error_threshold) against the masks the HF model's logprobs give. Qwen3-MoE: megatron's
router and experts against the HF model's logits, a step that trains the experts and not the frozen router.
megatron-core cannot run a forward pass on CPU, so nothing here runs on the CPU dry run.
"""

from __future__ import annotations

import math

import pytest

from gpu_env import cuda_count, need_module
from shapes import overrides

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=512,
             num_key_value_heads=2, vocab_size=1024, tied=False)
"""Grouped-query attention (4 heads per key/value head) and qwen2's q/k/v biases; builds in seconds."""


def need_megatron() -> None:
    if cuda_count() == 0:
        pytest.skip("no CUDA device: megatron-core needs CUDA for a forward pass")
    need_module("megatron", "bring megatron-core's wheel (tests/gpu/README.md)")


def megatron_config(tied: bool, precision: str = "float32", tp: int = 1, cp: int = 1):
    from trainer_harness import config

    return config(*overrides(SHAPE, tied=tied), f"policy.precision={precision}",
                  "policy.megatron_cfg.enabled=true", f"policy.megatron_cfg.tensor_model_parallel_size={tp}",
                  f"policy.megatron_cfg.context_parallel_size={cp}", "policy.max_total_sequence_length=64")


def build(cfg):
    from services.trainer.backends.megatron import MegatronBackend
    from services.trainer.distributed import init_distributed, trainer_device

    return MegatronBackend(cfg, init_distributed(600, trainer_device(cfg)))


def teardown_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def logits_gap(backend, cfg) -> tuple[float, float]:
    """(max |Megatron - HF| over the logits of one batch, max |HF logits|). Megatron's logits are split over the
    vocabulary under tensor parallelism: gathered first."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from services.common.modeling import load_policy

    hf, _ = load_policy(cfg.policy.model_copy(update={"precision": "float32"}), cfg.run.seed, "cuda")
    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
        backend.model.eval()
        got = gather_from_tensor_model_parallel_region(
            backend.model(input_ids=ids, position_ids=None, attention_mask=None)).float()
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item(), want.abs().max().item()


def chunking_gap(backend) -> tuple[float, float]:
    """policy.logprob_chunk_size's chunks of megatron's vocab-parallel cross entropy against the whole sequence at
    once, on the GPU: the largest difference in values, and in the logits' gradients (float32: Float16Module
    upcasts the logits it returns unless asked not to, as the backend's own forward asks)."""
    import torch

    from services.trainer.backends.megatron_model import vocab_parallel_logprobs

    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    logits = backend.model(input_ids=ids, position_ids=None, attention_mask=None)
    whole = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], 0.7, None)
    chunked = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], 0.7, 5)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits, retain_graph=True)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    return (whole - chunked).abs().max().item(), (g_whole - g_chunked).float().abs().max().item()


def step(backend, cfg, seed: int = 0) -> dict:
    from trainer_harness import step_batch

    batch, advantages = step_batch(cfg, seed=seed)
    backend.model.train()
    metrics = backend.train_step(batch, advantages)
    finite = math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert finite and metrics["grad_norm"] > 0, metrics
    return metrics


def check_manifest(backend, cfg, tied: bool) -> dict:
    import torch

    from services.common.weights import Manifest
    from services.rollout.engines.vllm import hf_manifest, meta_policy_model

    state = backend.full_state_dict()
    rollout = hf_manifest(meta_policy_model(cfg.policy, len(backend.tokenizer), cfg.run.seed))
    assert [s.name for s in Manifest.of(state).specs] == [s.name for s in rollout.specs]
    assert Manifest.of(state).digest == rollout.digest
    assert ("lm_head.weight" in state) == ("lm_head.weight" in [s.name for s in rollout.specs])
    if tied:
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return state


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_megatron_tp1_pp1_matches_hf_logits_steps_and_checkpoints(tied, tmp_path, figures):
    import torch

    need_megatron()
    cfg = megatron_config(tied)
    backend = build(cfg)
    try:
        gap, scale = logits_gap(backend, cfg)
        figures.update(logits_max_abs_diff=gap, logits_max_abs=scale)
        assert gap <= 1e-3 * max(1.0, scale), f"Megatron logits differ from HF's by {gap} (scale {scale})"
        figures["step1"] = step(backend, cfg)
        saved = check_manifest(backend, cfg, tied)
        directory = tmp_path / "step_1"
        directory.mkdir()  # as checkpoint.py makes it; the backend makes what it writes inside
        backend.save(directory)
        figures["checkpoint_files"] = sum(1 for p in directory.rglob("*") if p.is_file())
        step(backend, cfg, seed=1)
        moved = backend.full_state_dict()
        assert any(not torch.equal(moved[k], saved[k]) for k in saved), "the second step changed nothing"
        backend.load(directory)
        restored = backend.full_state_dict()
        assert all(torch.equal(restored[k], saved[k]) for k in saved), "load did not restore them"
    finally:
        teardown_megatron()


def test_megatron_bf16_step_runs_and_stays_near_hf_logits(figures):
    need_megatron()
    cfg = megatron_config(tied=True, precision="bfloat16")
    backend = build(cfg)
    try:
        gap, scale = logits_gap(backend, cfg)
        figures.update(logits_max_abs_diff=gap, logits_max_abs=scale)
        assert gap <= 0.05 * max(1.0, scale), f"bf16 Megatron logits differ from HF's float32 by {gap}"
        values, grads = chunking_gap(backend)
        figures.update(logprob_chunking_value_diff=values, logprob_chunking_grad_diff=grads)
        assert values <= 1e-5 and grads <= 1e-3, f"chunked vocab-parallel logprobs differ: {values}, {grads}"
        figures["step1"] = step(backend, cfg)
        check_manifest(backend, cfg, tied=True)
    finally:
        teardown_megatron()


def test_megatron_masks_the_samples_the_hf_models_logprobs_say_the_engine_got_wrong(figures):
    """grpo.seq_logprob_error_threshold under Megatron-Core (its forward-only pass before the step): the samples it
    masks are those whose error, from the logprobs of the Hugging Face model it was converted from, is above a
    threshold set in the widest gap between the errors (so numerics cannot move a sample across it)."""
    import torch
    from trainer_harness import step_batch

    from services.common.modeling import load_policy, token_logprobs

    need_megatron()
    cfg = megatron_config(tied=True)
    batch, advantages = step_batch(cfg)
    hf, _ = load_policy(cfg.policy.model_copy(update={"precision": "float32"}), cfg.run.seed)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    prev = token_logprobs(logits, batch.targets, cfg.policy.generation.temperature)
    mask = batch.token_mask * batch.sample_mask[:, None]
    errors = ((torch.exp((batch.generation_logprobs - prev).abs() * mask) * mask).sum(-1) / mask.sum(-1)).sort().values
    gap = int((errors[1:] - errors[:-1]).argmax())
    threshold = float((errors[gap] + errors[gap + 1]) / 2)
    backend = build(cfg.model_copy(update={"grpo": cfg.grpo.model_copy(
        update={"seq_logprob_error_threshold": threshold})}))
    try:
        backend.model.train()
        metrics = backend.train_step(batch, advantages)
        figures.update(threshold=threshold, masked=metrics["num_masked_seqs_by_logprob_error"])
        assert metrics["num_masked_seqs_by_logprob_error"] == len(errors) - gap - 1, metrics
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0, metrics
    finally:
        teardown_megatron()


def test_megatron_qwen3_moe_matches_hf_logits_and_steps_the_experts_not_the_frozen_router(figures):
    """Qwen3-MoE at TP = PP = EP = 1 (expert and sequence parallelism need 2 GPUs): 8 experts, top 2 renormalised,
    routed in float64 through megatron's alltoall dispatcher, as NeMo RL's Qwen3-30B-A3B recipes ask."""
    need_megatron()
    try:
        figures.update(moe_logits_and_step(build(moe_config()), moe_config(), rank=0))
    finally:
        teardown_megatron()


def moe_config(*parallel: str):
    from trainer_harness import config

    return config(*overrides(SHAPE, tied=False), "policy.tiny.architecture=qwen3_moe", "policy.tiny.num_experts=8",
                  "policy.hf_config_overrides.norm_topk_prob=true", "policy.megatron_cfg.enabled=true",
                  "policy.megatron_cfg.moe_router_dtype=fp64", "policy.max_total_sequence_length=64", *parallel)


def moe_logits_and_step(backend, cfg, rank: int) -> dict:
    """The MoE model's logits against HF's, then one step: the experts move, the frozen router does not (the
    weights as rollout gets them, on rank 0)."""
    import torch

    gap, scale = logits_gap(backend, cfg)
    assert gap <= 1e-3 * max(1.0, scale), f"Megatron MoE logits differ from HF's by {gap} (scale {scale})"
    before = check_manifest(backend, cfg, tied=False) if rank == 0 else backend.full_state_dict()
    metrics = step(backend, cfg)
    after = backend.full_state_dict()
    if rank == 0:
        router, experts = "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"
        assert torch.equal(after[router], before[router]), "the frozen router moved"
        assert not torch.equal(after[experts], before[experts]), "the step did not train the experts"
    return dict(logits_max_abs_diff=gap, logits_max_abs=scale, step1=metrics)

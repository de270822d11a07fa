"""Stage `multi_gpu`: what needs two GPUs or more, or vLLM. Written, and skipped with the reason where the
machine lacks them (the one-H100 check machine lacks both: NCCL refuses two ranks on one device, and vLLM's
CUDA build, about 0.5 GB installed, cannot travel in a 64 MiB carry of wheels). Run them where they can run:
`python tests/gpu/run.py --only multi_gpu --timeout multi_gpu=600`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from gpu_env import DEVICE, REPO, SLURM_NCCL_ENV, need_gpus, need_module, store_of

pytestmark = pytest.mark.gpu

VLLM_WHY = ("vLLM's CUDA wheel (~0.5 GB installed, its own torch pin) cannot travel in the check's 64 MiB "
            "carry; run this on a machine with vLLM installed")


DRY = DEVICE == "cpu"
"""The CPU dry run runs the choreography of the checks that allow it with gloo and CPU ranks instead."""


def _need_gpus_unless_dry(n: int) -> None:
    if not DRY:
        need_gpus(n)


def _sender(rounds: str, deadline_s: float, large_numel: int, bucket_bytes: int) -> subprocess.Popen:
    where = ["--backend", "gloo", "--device", "cpu"] if DRY else ["--backend", "nccl", "--device", "cuda:0"]
    argv = [sys.executable, str(REPO / "tests" / "gpu" / "nccl_sender.py"), *where, "--rounds", rounds,
            "--timeout", str(deadline_s), "--large-numel", str(large_numel),
            "--bucket-bytes", str(bucket_bytes)]
    return subprocess.Popen(argv, env=SLURM_NCCL_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def _round(sender: subprocess.Popen) -> dict:
    sender.stdin.write("go\n")
    sender.stdin.flush()
    line = sender.stdout.readline()
    assert line, f"the trainer process died (code {sender.poll()}):\n{sender.stderr.read()[-2000:]}"
    return json.loads(line)


def test_nccl_receiver_killed_mid_broadcast_is_dropped_and_the_next_sync_succeeds(figures):
    """Trainer on cuda:0 (its own process), receiver on cuda:1 unpacking slowly, SIGKILLed mid-transfer. The
    sync must return within its deadline with the receiver dropped, the trainer process must survive torch's
    NCCL watchdog, and a fresh receiver must then get the next version bitwise."""
    from weights_harness import outcomes, spawn

    _need_gpus_unless_dry(2)
    deadline_s, numel = 20.0, 300_000
    backend, device = ("gloo", "cpu") if DRY else ("nccl", "cuda:1")
    sender = _sender("w1;w2", deadline_s, numel, bucket_bytes=512)  # a dozen packed buckets: ~12 s to unpack
    store = store_of(sender)
    slow = spawn(store, "w1", backend=backend, device=device, sleep_per_bucket=1.0, large_numel=numel,
                 timeout_s=deadline_s + 10)
    sender.stdin.write("go\n")
    sender.stdin.flush()
    time.sleep(2.5)  # joined (within ~0.5 s) and unpacking its first buckets, ~1 s each
    os.kill(slow.pid, signal.SIGKILL)
    start = time.monotonic()
    first = json.loads(sender.stdout.readline() or "{}")
    figures["first"] = {k: first.get(k) for k in ("members_ok", "members_dropped", "seconds", "attempts")}
    assert first.get("members_dropped") == ["w1"] and first["seconds"] < deadline_s + 5, (
        first, sender.stderr.read()[-2000:] if not first else "")
    fresh = spawn(store, "w2", backend=backend, device=device, large_numel=numel, timeout_s=deadline_s + 10)
    second = _round(sender)
    got = [o for o in outcomes(fresh, timeout=deadline_s + 10) if o["event"] == "received"]
    sender.stdin.close()
    code = sender.wait(timeout=30)
    figures.update(second_seconds=second["seconds"], after_kill_s=round(time.monotonic() - start, 2))
    assert second["members_ok"] == ["w2"] and [(o["version"], o["equal"]) for o in got] == [(2, True)]
    assert code == 0, sender.stderr.read()[-2000:]


def _fsdp2_rank(rank: int, parallel: tuple[str, ...]) -> None:
    """One bf16 FSDP2 step on this rank's GPU (the dry run: on CPU, gloo), split as `parallel` says, and the whole
    weights on rank 0."""
    from services.trainer.backends.fsdp2 import FSDP2Backend
    from services.trainer.distributed import init_distributed
    from shapes import TINY, overrides
    from trainer_harness import config, step_batch

    cfg = config(*overrides(dict(TINY, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)),
                 "policy.precision=bfloat16", *parallel, f"trainer.device={DEVICE}")
    backend = FSDP2Backend(cfg, init_distributed(300, DEVICE))
    metrics = backend.train_step(*step_batch(cfg))
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]), metrics
    state = backend.full_state_dict()
    assert rank != 0 or "model.embed_tokens.weight" in state


def test_fsdp2_tensor_parallel_2_steps_on_two_gpus():
    from trainer_harness import run_ranks

    _need_gpus_unless_dry(2)
    run_ranks(2, _fsdp2_rank, ("policy.tensor_parallel_size=2",))


def test_fsdp2_expert_parallel_2_steps_on_two_gpus():
    """A Qwen3-MoE's experts split over the two GPUs, tokens dispatched by NCCL all-to-all (on CPU, gloo:
    tests/unit/trainer/test_expert_parallel.py)."""
    from trainer_harness import run_ranks

    _need_gpus_unless_dry(2)
    run_ranks(2, _fsdp2_rank, ("policy.tiny.architecture=qwen3_moe", "policy.expert_parallel_size=2"))


def test_fsdp2_context_parallel_2_steps_on_two_gpus():
    """Each row's positions split over the two GPUs, keys and values gathered by NCCL (on CPU, gloo:
    tests/unit/trainer/test_context_parallel.py)."""
    from trainer_harness import run_ranks

    _need_gpus_unless_dry(2)
    run_ranks(2, _fsdp2_rank, ("policy.context_parallel_size=2",))


def _megatron_tp2_rank(rank: int) -> None:
    from test_megatron_gpu import build, logits_gap, megatron_config, step

    cfg = megatron_config(tied=False, tp=2)
    backend = build(cfg)
    gap, scale = logits_gap(backend, cfg)
    assert gap <= 1e-3 * max(1.0, scale), (gap, scale)
    step(backend, cfg)
    state = backend.full_state_dict()
    assert rank != 0 or "lm_head.weight" in state


def test_megatron_tensor_parallel_2_matches_hf_logits_and_steps():
    from trainer_harness import run_ranks

    need_gpus(2)
    need_module("megatron", "bring megatron-core's wheel (tests/gpu/README.md)")
    run_ranks(2, _megatron_tp2_rank)


def _megatron_moe_rank(rank: int) -> None:
    from test_megatron_gpu import build, moe_config, moe_logits_and_step

    cfg = moe_config("policy.megatron_cfg.tensor_model_parallel_size=2",
                     "policy.megatron_cfg.expert_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true")
    moe_logits_and_step(build(cfg), cfg, rank)


def test_megatron_qwen3_moe_at_tp_2_ep_2_with_sequence_parallelism_matches_hf_logits_and_steps():
    """Each GPU holds half the experts of every layer and half of every dense weight, and a half of each sequence
    between the attention and MLP blocks."""
    from trainer_harness import run_ranks

    need_gpus(2)
    need_module("megatron", "bring megatron-core's wheel (tests/gpu/README.md)")
    run_ranks(2, _megatron_moe_rank)


def _megatron_cp2_rank(rank: int) -> None:
    import torch
    from test_megatron_gpu import build, megatron_config, step
    from trainer_harness import step_batch

    from services.common.modeling import load_policy, token_logprobs
    from services.trainer.backends.megatron import micro_batches

    cfg = megatron_config(tied=False, cp=2)
    backend = build(cfg)
    batch, _ = step_batch(cfg)
    got = backend._all_logprobs(batch, micro_batches(len(batch), 0, 1, cfg.policy.train_micro_batch_size, 1))
    hf, _ = load_policy(cfg.policy.model_copy(update={"precision": "float32"}), cfg.run.seed, "cuda")
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda()).logits[:, :-1]
    want = token_logprobs(logits, batch.targets.cuda(), cfg.policy.generation.temperature).cpu()
    gap = (got - want)[batch.token_mask.bool()].abs().max().item()
    assert gap <= 1e-3, f"context-parallel logprobs differ from HF's by {gap}"
    step(backend, cfg)


def test_megatron_context_parallel_2_gives_the_hf_models_logprobs_and_steps():
    """Each GPU holds two mirrored chunks of every row (megatron's layout), attends over the whole row's keys
    (megatron_context_parallel.py), and gives back the whole row's logprobs."""
    from trainer_harness import run_ranks

    need_gpus(2)
    need_module("megatron", "bring megatron-core's wheel (tests/gpu/README.md)")
    run_ranks(2, _megatron_cp2_rank)


def test_nccl_trainer_to_vllm_rollout_trains_5_steps(tmp_path, figures):
    """The GPU path users take: FSDP2 trainer on one GPU, a vLLM worker on another, weights over NCCL."""
    need_module("vllm", VLLM_WHY)
    need_gpus(2)
    _flywheel_up(tmp_path, figures, ["policy.generation.backend=vllm", "weight_sync.backend=nccl"])


def test_vllm_tensor_parallel_2_rollout_trains_5_steps(tmp_path, figures):
    need_module("vllm", VLLM_WHY)
    need_gpus(3)
    _flywheel_up(tmp_path, figures, ["policy.generation.backend=vllm", "weight_sync.backend=nccl",
                                     "policy.generation.vllm_cfg.tensor_parallel_size=2"])


def _flywheel_up(tmp_path, figures: dict, extra: list[str], steps: int = 5) -> None:
    from services.local import read_metrics
    from test_stack_gpu import DEVICE_OVERRIDES

    argv = [sys.executable, "-m", "services.cli", "up", "--run-dir", str(tmp_path / "run"),
            f"grpo.max_num_steps={steps}", "checkpointing.enabled=false", "policy.precision=bfloat16", *extra,
            *DEVICE_OVERRIDES]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=540)
    rows = read_metrics(tmp_path / "run")
    figures.update(steps=len(rows), summary=out.stdout.splitlines()[-6:])
    assert out.returncode == 0 and len(rows) == steps, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"

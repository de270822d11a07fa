"""GPU memory of the trainer's step under its optimizer-memory settings, side by side in one process.

    python benchmarks/optimizer_memory.py [--shape 0.5b|tiny] [--steps 3] [--samples 32]

One rank (on CUDA when there is one, else CPU, where nothing is measured but the code runs). For each setting a
fresh FSDP2Backend of Qwen2-0.5B's shape (hidden 896, 24 layers, vocabulary 151936, tied; built from a config, random
weights) in bf16 with activation checkpointing and a KL penalty (a reference forward each step) steps the same batch:
- adamw fp32: torch's AdamW, float32 moments
- bf16 moments: policy.optimizer.moments_dtype=bfloat16
- bf16 moments + offload: and policy.offload_optimizer_for_logprob=true
Reported for each: GPU memory allocated when the reference forward of the last step starts (what the logprob forwards
work with), the peak over the steps after the first (the state exists from the first step on), and the median step
seconds after the first; and each as a ratio to adamw fp32 from the same run. docs/benchmarks.md keeps the figures.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from trainer import batch_of

from services.common.config import load_config
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.batch import batch_advantages
from services.trainer.distributed import init_distributed

SHAPES = {"0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864,
                       kv=2, vocab=151936),
          "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, kv=1,
                       vocab=1024)}
SETTINGS = {"adamw fp32": [], "bf16 moments": ["policy.optimizer.moments_dtype=bfloat16"],
            "bf16 moments + offload": ["policy.optimizer.moments_dtype=bfloat16",
                                       "policy.offload_optimizer_for_logprob=true"]}


def model_overrides(shape: dict) -> list[str]:
    hf = f"{{num_key_value_heads: {shape['kv']}, vocab_size: {shape['vocab']}, tie_word_embeddings: true}}"
    return ["policy.tiny.architecture=qwen2", f"policy.hf_config_overrides={hf}",
            *(f"policy.tiny.{k}={shape[k]}" for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                      "intermediate_size"))]


def measure(cfg, batch, advantages, steps: int, cuda: bool) -> dict:
    backend = FSDP2Backend(cfg, init_distributed(600, "cuda" if cuda else "cpu"))
    allocated = (lambda: torch.cuda.memory_allocated() / 2**30) if cuda else (lambda: 0.0)
    at_reference: list[float] = []
    backend.reference.register_forward_pre_hook(lambda *_: at_reference.append(allocated()))
    seconds = []
    for i in range(steps):
        if cuda and i == 1:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        backend.train_step(batch, advantages)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    out = {"at_reference_gib": at_reference[-1], "step_s": statistics.median(seconds[1:]),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0}
    del backend
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="0.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    base = [*model_overrides(SHAPES[args.shape]), "policy.precision=bfloat16", "policy.activation_checkpointing=true",
            "loss_fn.reference_policy_kl_penalty=0.01", "policy.max_total_sequence_length=256",
            "policy.train_micro_batch_size=8", f"trainer.device={'cuda' if cuda else 'cpu'}",
            "policy.optimizer.kwargs.lr=1e-5"]
    batch = batch_of(args.samples)
    results = {}
    for name, extra in SETTINGS.items():
        cfg = load_config(None, [*base, *extra])
        advantages, _ = batch_advantages(batch, cfg.grpo)
        results[name] = measure(cfg, batch, advantages, args.steps, cuda)
    where = torch.cuda.get_device_name() if cuda else "CPU (no GPU memory to measure)"
    print(f"{args.shape} shape, {len(batch)} samples, {args.steps} steps, on {where}")
    first = results["adamw fp32"]
    for name, r in results.items():
        ratio = {k: r[k] / first[k] if first[k] else float("nan") for k in r}
        print(f"{name:24s} at reference {r['at_reference_gib']:6.2f} GiB ({ratio['at_reference_gib']:.2f})  "
              f"peak {r['peak_gib']:6.2f} GiB ({ratio['peak_gib']:.2f})  step {r['step_s']:.3f} s ({ratio['step_s']:.2f})")


if __name__ == "__main__":
    main()

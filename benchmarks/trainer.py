"""The trainer's tokens/s beside a bare torch loop of the same model and batch, in one process.

    python benchmarks/trainer.py [--steps 12] [--samples 64] [key=value ...]

Both sides do a GRPO step's work on the same padded batch: a no-grad forward for the prev
logprobs, then forward and backward per micro-batch, clip, AdamW step. The trainer side is
FSDP2Backend.train_step (plan, micro-batch cutting, the clipped PG loss with its metrics,
metric combination); the bare side is the shortest loop that does the same arithmetic, on a model wrapped as the
backend wraps it (fully_shard on GPU or with more than one rank; in one CPU process, a plain module).
Steps alternate between the two sides and the median step
time counts. Tokens are real (non-padding) tokens. The ratio trainer/bare is what the trainer's
machinery costs; docs/trainer.md keeps the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from services.common.config import load_config
from services.common.modeling import load_policy, token_logprobs
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.batch import batch_advantages, build_batch
from services.trainer.distributed import init_distributed

WARMUP = 3
MODEL = ["policy.tiny.hidden_size=256", "policy.tiny.num_hidden_layers=4", "policy.tiny.num_attention_heads=8",
         "policy.tiny.intermediate_size=768", "policy.train_micro_batch_size=16", "policy.max_total_sequence_length=128"]


def batch_of(samples: int, seed: int = 0):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(samples // 8):
        prompt = torch.randint(4, 40, (16,), generator=g).tolist()
        completions = [SimpleNamespace(token_ids=torch.randint(4, 40, (n,), generator=g).tolist(),
                                       generated_mask=[True] * n, generation_logprobs=[-1.0] * n, version_start=0,
                                       reward=float(j % 2), truncated=False, named_rewards={})
                       for j, n in enumerate(torch.randint(24, 64, (8,), generator=g).tolist())]
        groups.append(SimpleNamespace(prompt_id=str(i), env_name="b", prompt_token_ids=prompt, completions=completions))
    return build_batch(groups, pad_id=0)


def timed(steps: int, *fns) -> list[float]:
    """Median seconds per call of each fn, calls interleaved (a, b, a, b, ...) so that load from
    other processes on a shared machine falls on both sides alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t[WARMUP:]) for t in times]


def bare_loop(cfg, batch, advantages):
    model, _ = load_policy(cfg.policy, cfg.run.seed)
    if torch.cuda.is_available() or dist.get_world_size() > 1:  # the backend's rule (FSDP2Backend._shard)
        for layer in model.model.layers:
            fully_shard(layer)
        model = fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    mask = batch.token_mask
    size = cfg.policy.train_micro_batch_size

    def logprobs(rows):
        logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits
        return token_logprobs(logits[:, :-1], batch.targets[rows])

    def step():
        parts = [slice(i, i + size) for i in range(0, len(batch), size)]
        with torch.no_grad():
            prev = torch.cat([logprobs(p) for p in parts])
        model.train()
        optimizer.zero_grad()
        for p in parts:
            ratio = torch.exp(logprobs(p) - prev[p])
            a = advantages[p, None]
            loss = (torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * mask[p]).sum() / mask.sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.eval()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, [*MODEL, "policy.optimizer.kwargs.lr=1e-4", *args.overrides])
    init_distributed(600)
    batch = batch_of(args.samples)
    advantages, _ = batch_advantages(batch, cfg.grpo)
    tokens = int(batch.attention_mask.sum())
    backend = FSDP2Backend(cfg, init_distributed(600))
    trainer_s, bare_s = timed(args.steps, lambda: backend.train_step(batch, advantages),
                              bare_loop(cfg, batch, advantages))
    print(f"batch: {len(batch)} samples, {tokens} tokens; model {MODEL[:4]}")
    print(f"trainer (FSDP2Backend.train_step): {tokens / trainer_s:8.0f} tokens/s  ({trainer_s:.3f} s/step)")
    print(f"bare torch loop                  : {tokens / bare_s:8.0f} tokens/s  ({bare_s:.3f} s/step)")
    print(f"ratio trainer / bare             : {bare_s / trainer_s:.3f}")


if __name__ == "__main__":
    main()

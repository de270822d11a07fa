"""The trainer's tokens/s beside a bare torch loop of the same model and batch, in one process.

    python benchmarks/trainer.py [--algorithm grpo|sft|dpo] [--steps 12] [--samples 64] [key=value ...]

Both sides do one step's work on the same padded batch, forward and backward per micro-batch, clip, AdamW step:
- grpo: a no-grad forward for the prev logprobs first, then the clipped PG loss. Trainer side
  FSDP2Backend.train_step (plan, micro-batch cutting, the loss with its metrics, metric combination).
- sft: the token-level NLL over the step's valid tokens. Trainer side FSDP2Backend.offline_step.
- dpo: rows 2k and 2k+1 a pair; the frozen reference's logprobs first (no grad), then NeMo RL's preference loss
  -log σ(β((π_c - ref_c) - (π_r - ref_r))) over the pairs. Trainer side FSDP2Backend.offline_step.
The bare side is the shortest loop that does the same arithmetic, on a model wrapped as the
backend wraps it (fully_shard on GPU or with more than one rank; in one CPU process, a plain module).
Steps alternate between the two sides and the median step
time counts. Tokens are real (non-padding) tokens. The ratio trainer/bare is what the trainer's
machinery costs; docs/trainer.md keeps the figures.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


def bare_model(cfg):
    model, _ = load_policy(cfg.policy, cfg.run.seed)
    if torch.cuda.is_available() or dist.get_world_size() > 1:  # the backend's rule (FSDP2Backend._shard)
        for layer in model.model.layers:
            fully_shard(layer)
        model = fully_shard(model)
    return model


def bare_loop(cfg, batch, advantages):
    """The step for cfg.algorithm, as the shortest torch loop; returns step()."""
    model = bare_model(cfg)
    reference = copy.deepcopy(model).eval() if cfg.algorithm == "dpo" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    mask = batch.token_mask
    size = cfg.policy.train_micro_batch_size
    parts = [slice(i, i + size) for i in range(0, len(batch), size)]  # size is even: pairs stay together

    def logprobs(net, rows):
        logits = net(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits
        return token_logprobs(logits[:, :-1], batch.targets[rows])

    def grpo_loss(p, prev):
        ratio = torch.exp(logprobs(model, p) - prev[p])
        a = advantages[p, None]
        return (torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)) * mask[p]).sum() / mask.sum()

    def sft_loss(p, _):
        return -(logprobs(model, p) * mask[p]).sum() / mask.sum()

    def dpo_loss(p, ref):
        beta = cfg.dpo.reference_policy_kl_penalty
        margin = ((logprobs(model, p) - ref[p]) * mask[p]).sum(-1)
        return -F.logsigmoid(beta * (margin[0::2] - margin[1::2])).sum() / (len(batch) // 2)

    loss_of = {"grpo": grpo_loss, "sft": sft_loss, "dpo": dpo_loss}[cfg.algorithm]
    first_pass = {"grpo": model, "sft": None, "dpo": reference}[cfg.algorithm]

    def step():
        fixed = None
        if first_pass is not None:  # grpo's prev logprobs, dpo's reference logprobs
            with torch.no_grad():
                fixed = torch.cat([logprobs(first_pass, p) for p in parts])
        model.train()
        optimizer.zero_grad()
        for p in parts:
            loss_of(p, fixed).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.eval()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithm", choices=("grpo", "sft", "dpo"), default="grpo")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # An offline run's config needs a dataset; this one is never read (the batch is made here).
    section = [] if args.algorithm == "grpo" else [f"++{args.algorithm}={{}}", "environments=[]",
                                                   "++data.train={data_path: unread.jsonl}"]
    cfg = load_config(None, [*MODEL, *section, "policy.optimizer.kwargs.lr=1e-4", *args.overrides])
    init_distributed(600)
    batch = batch_of(args.samples)
    advantages, _ = batch_advantages(batch, cfg.grpo)
    tokens = int(batch.attention_mask.sum())
    backend = FSDP2Backend(cfg, init_distributed(600))
    step = ((lambda: backend.train_step(batch, advantages)) if args.algorithm == "grpo"
            else (lambda: backend.offline_step(batch)))
    trainer_s, bare_s = timed(args.steps, step, bare_loop(cfg, batch, advantages))
    print(f"{args.algorithm} batch: {len(batch)} samples, {tokens} tokens; model {MODEL[:4]}")
    print(f"trainer (FSDP2Backend)           : {tokens / trainer_s:8.0f} tokens/s  ({trainer_s:.3f} s/step)")
    print(f"bare torch loop                  : {tokens / bare_s:8.0f} tokens/s  ({bare_s:.3f} s/step)")
    print(f"ratio trainer / bare             : {bare_s / trainer_s:.3f}")


if __name__ == "__main__":
    main()

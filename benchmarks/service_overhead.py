"""Service overhead: synchronous GRPO through the five services vs the same work in one process vs a plain loop.

    python benchmarks/service_overhead.py [--steps 40] [key=value ...]

Three sides, one config, the same model (built by `load_policy`) and batch shape, printed side by side:

- plain: no Flywheel code. One batched `generate` over every prompt x G, the toy_copy reward inline,
  group-normalised advantages, one forward/backward of the policy-gradient loss and one optimizer step
  on the same module that generates (no weight copy, no FSDP, no prev-logprob recompute): the floor.
- one process: the engine (HF), environment, batch building and FSDP2 policy the services use, called
  directly; weights copied with load_state_dict.
- five services: `flywheel up`'s stack with k = 0, so nothing overlaps; the difference to "one process"
  is what NATS, gRPC, Redis, the weight channel and process boundaries cost.

Each side reports wall and CPU seconds per step (CPU: this process for the first two, every child of the
stack, NATS and Redis included, for the third), and the stack's per-step breakdown from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from services.common.config import load_config
from services.common.modeling import load_policy
from services.environment.base import make_environment
from services.local import LocalStack
from services.rollout.engines import Sampling
from services.rollout.engines.hf import HFEngine
from services.rollout.episodes import prompt_token_ids
from services.trainer.algorithms import compute_advantages
from services.trainer.batch import build_batch
from services.trainer.backends.fsdp2 import FSDP2Backend
from services.trainer.distributed import init_distributed
from stack_cpu import cpu_per_step

WARMUP = 3


def plain(cfg) -> tuple[list[float], float]:
    """GRPO with nothing but torch and transformers (the model and tokenizer built as the others build them)."""
    torch.set_num_threads(1)
    model, tok = load_policy(cfg.policy, cfg.run.seed, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), **cfg.policy.optimizer.kwargs)
    g = cfg.grpo
    P, G, T = g.num_prompts_per_step, g.num_generations_per_prompt, cfg.policy.generation.temperature
    walls, cpus = [], []
    for step in range(g.max_num_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        digits = [str(random.Random(f"toy_copy:{cfg.run.seed}:{i}").randrange(5))
                  for i in range(step * P, (step + 1) * P)]
        texts = [tok.apply_chat_template([{"role": "user", "content": f"copy {d}"}], add_generation_prompt=True,
                                         tokenize=False) for d in digits]
        prompts = [tok(t, add_special_tokens=False).input_ids for t in texts for _ in range(G)]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width) >= width - torch.tensor([len(p) for p in prompts])[:, None]).long()
        with torch.no_grad():
            model.eval()
            seqs = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=T,
                                  top_p=1.0, top_k=0, max_new_tokens=cfg.policy.generation.max_new_tokens,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        new = seqs[:, width:]
        answers = tok.batch_decode(new, skip_special_tokens=True)
        rewards = torch.tensor([float(a.lstrip()[:1] == digits[i // G]) for i, a in enumerate(answers)])
        r = rewards.view(P, G)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
        gen_mask = (new != tok.pad_token_id).float()
        full_mask = torch.cat([mask, gen_mask.long()], 1)
        model.train()
        logits = model(input_ids=seqs, attention_mask=full_mask).logits[:, width - 1:-1] / T
        logp = torch.log_softmax(logits.float(), -1).gather(-1, new[..., None]).squeeze(-1)
        loss = -(adv * logp * gen_mask).sum() / gen_mask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls[WARMUP:], _mean(cpus)


def _mean(values) -> float:
    values = list(values)[WARMUP:]
    return sum(values) / len(values)


def in_process(cfg) -> tuple[list[float], float]:
    torch.set_num_threads(1)
    engine, policy = HFEngine(cfg, "benchmark"), FSDP2Backend(cfg, init_distributed(600))
    env = make_environment("toy_copy")
    g = cfg.grpo
    sampling = Sampling.resolve(cfg.policy.generation)
    walls, cpus, phases = [], [], []
    for step in range(g.max_num_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        rows = env.prompts(g.num_prompts_per_step, cfg.run.seed, step * g.num_prompts_per_step)

        async def rollout(rows, step=step):  # as a rollout worker: groups_in_flight groups at once
            slots = asyncio.Semaphore(cfg.groups_in_flight)

            async def one(i, row):
                async with slots:
                    ids = prompt_token_ids(engine.tokenizer, row["messages"])
                    outs = await engine.generate([ids] * g.num_generations_per_prompt, sampling)
                    convs = [row["messages"] + [{"role": "assistant", "content": o.text}] for o in outs]
                    scored = env.step(convs, [row["metadata"]] * len(outs))
                return SimpleNamespace(prompt_id=str(i), env_name="toy", prompt_token_ids=ids, completions=[
                    SimpleNamespace(token_ids=o.token_ids, generated_mask=[True] * len(o.token_ids),
                                    generation_logprobs=o.logprobs, reward=r.reward, version_start=step,
                                    truncated=o.truncated, named_rewards=r.named_rewards)
                    for o, r in zip(outs, scored)])

            return await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))

        groups = asyncio.run(rollout(rows))
        t1 = time.perf_counter()
        batch = build_batch(groups, engine.tokenizer.pad_token_id)
        adv, _ = compute_advantages(batch.rewards, batch.prompt_ids, batch.sample_mask > 0,
                                    use_leave_one_out_baseline=g.use_leave_one_out_baseline,
                                    normalize_rewards=g.normalize_rewards)
        policy.train_step(batch, adv)
        t2 = time.perf_counter()
        engine.model.load_state_dict(policy.full_state_dict())
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        phases.append((t1 - t0, t2 - t1, walls[-1] - (t2 - t0)))
    IN_PROCESS_PHASES.update(zip(("rollout", "training", "weights"), map(_mean, zip(*phases))))
    return walls[WARMUP:], _mean(cpus)


IN_PROCESS_PHASES: dict[str, float] = {}
"""The one-process loop's mean seconds per phase: generation and environment, batch and training, weight copy."""


def through_services(cfg) -> tuple[list[float], float, list[dict], dict[str, float]]:
    """Wall seconds of each step and mean CPU seconds per step (after WARMUP), the measured rows, and CPU seconds
    per step by child."""
    steps = cfg.grpo.max_num_steps
    with tempfile.TemporaryDirectory() as tmp, LocalStack(cfg, Path(tmp)) as stack:
        stack.start_services()
        per_child = cpu_per_step(stack, WARMUP, steps)
        rows = stack.wait_for(lambda rows: len(rows) >= steps, f"{steps} steps", timeout_s=3600)
    rows = rows[WARMUP:]
    return [r["timing/train/total_step_time"] for r in rows], sum(per_child.values()), rows, per_child


def _avg(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


BREAKDOWN = [
    ("lease delay", "timing/train/lease_delay", "sync end -> first lease: weights loaded, WeightLoaded, controller"),
    ("rollout", "timing/train/rollout_span", "first lease -> last group finished: queue, generation, environment"),
    ("ingest", "timing/train/ingest", "last group finished -> batch in the trainer: publish, ingest, Sample"),
    ("batch build", "timing/train/batch_build", "build_batch + advantages"),
    ("logprobs", "timing/train/logprobs", "prev-logprob recompute"),
    ("optimizer", "timing/train/optimizer", "loss, backward, optimizer step"),
    ("weight gather", "timing/train/weight_gather", "full_state_dict"),
    ("sync announce", "timing/train/weight_sync/announce", "store keys + NATS announcement"),
    ("sync join", "timing/train/weight_sync/join", "until every worker joined"),
    ("sync send", "timing/train/weight_sync/send", "the backend's transfer"),
    ("sync confirm", "timing/train/weight_sync/confirm", "until every checksum came back"),
    ("checkpoint", "timing/train/checkpoint", "checkpoint saves, averaged over the steps"),
]
INSIDE = [
    ("generation", "timing/train/generation", "engine calls, summed over groups (they overlap)"),
    ("environment", "timing/train/environment", "environment Step rpcs, summed over groups"),
    ("Sample rpc", "timing/train/replay", "the Sample call that returned the batch"),
]


def print_breakdown(rows: list[dict]) -> None:
    step = _avg(rows, "timing/train/total_step_time")
    if not any(key in rows[-1] for _, key, _ in BREAKDOWN):
        print("five services: no breakdown (this trainer records no timing/train/lease_delay etc.)")
        return
    print(f"five services, mean of {len(rows)} steps ({step:.3f} s), where the time goes:")
    for label, key, what in BREAKDOWN:
        print(f"  {label:<14} {_avg(rows, key):7.3f} s  {what}")
    rest = step - sum(_avg(rows, key) for _, key, _ in BREAKDOWN)
    print(f"  {'remainder':<14} {rest:7.3f} s  step bookkeeping, report, the trainer's own scheduling")
    print("  one process, same run: " + ", ".join(f"{k} {v:.3f} s" for k, v in IN_PROCESS_PHASES.items()))
    print("  inside the rows above:")
    for label, key, what in INSIDE:
        print(f"    {label:<12} {_avg(rows, key):7.3f} s  {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    # No checkpoints: the other two sides save none, and a save is not a per-step cost of the services.
    cfg = load_config(None, [f"grpo.max_num_steps={args.steps}", "grpo.async_grpo.enabled=false",
                             "checkpointing.enabled=false", *args.overrides])
    floor_walls, floor_cpu = plain(cfg)
    direct_walls, direct_cpu = in_process(cfg)
    services_walls, services_cpu, rows, per_child = through_services(cfg)
    print(f"{'per step':<26} {'wall s':>7} {'median':>7} {'cpu s':>7}")
    for name, walls, cpu in (("plain loop (no Flywheel)", floor_walls, floor_cpu),
                             ("one process", direct_walls, direct_cpu), ("five services", services_walls, services_cpu)):
        print(f"{name:<26} {statistics.mean(walls):7.3f} {statistics.median(walls):7.3f} {cpu:7.3f}")
    # Both: one slow step (a GC pause, a neighbour's burst on this shared machine) moves a 30-step mean by ms.
    for label, average in (("overhead per step", statistics.mean), ("by the medians", statistics.median)):
        floor, direct, services = map(average, (floor_walls, direct_walls, services_walls))
        print(f"{label:<26}: {services - direct:+.3f} s  (ratio {services / direct:.2f}x) over one process; "
              f"{services - floor:+.3f} s ({services / floor:.2f}x) over the plain loop")
    print("cpu s per step by process : " + "  ".join(f"{n} {v:.3f}" for n, v in
                                                     sorted(per_child.items(), key=lambda kv: -kv[1])))
    print_breakdown(rows)


if __name__ == "__main__":
    main()

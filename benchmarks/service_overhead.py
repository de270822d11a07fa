"""Service overhead: synchronous GRPO through the five services vs the same work in one process.

    python benchmarks/service_overhead.py [--steps 40] [key=value ...]

Both sides use the same engine (HF), environment, batch building, FSDP2 policy and config;
the in-process loop calls them directly and copies weights with load_state_dict. The stack
runs with max_staleness=0 so nothing overlaps. The difference per step is what NATS, gRPC,
Redis, the weight channel and process boundaries cost.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from services.common.config import load_config
from services.environment.base import make_environment
from services.local import LocalStack
from services.rollout.engine import HFEngine, Sampling
from services.rollout.episodes import prompt_token_ids
from services.trainer.algorithms import compute_advantages
from services.trainer.batch import build_batch
from services.trainer.fsdp2 import FSDP2Policy

WARMUP = 3


def in_process(cfg) -> float:
    torch.set_num_threads(1)
    engine, policy = HFEngine(cfg), FSDP2Policy(cfg)
    env = make_environment("toy_copy")
    g = cfg.grpo
    sampling = Sampling.resolve(cfg.policy.generation)
    times = []
    for step in range(g.max_num_steps):
        t0 = time.perf_counter()
        rows = env.prompts(g.num_prompts_per_step, cfg.run.seed, step * g.num_prompts_per_step)
        groups = []
        for i, row in enumerate(rows):
            ids = prompt_token_ids(engine.tokenizer, row["messages"])
            outs = engine.generate([ids] * g.num_generations_per_prompt, sampling)
            convs = [row["messages"] + [{"role": "assistant", "content": o.text}] for o in outs]
            scored = env.step(convs, [row["metadata"]] * len(outs))
            groups.append(SimpleNamespace(prompt_id=str(i), env_name="toy", prompt_token_ids=ids, completions=[
                SimpleNamespace(token_ids=o.token_ids, generated_mask=[True] * len(o.token_ids),
                                generation_logprobs=o.logprobs, reward=r.reward, version_start=step,
                                truncated=o.truncated) for o, r in zip(outs, scored)]))
        batch = build_batch(groups, engine.tokenizer.pad_token_id)
        adv, _ = compute_advantages(batch.rewards, batch.prompt_ids, batch.sample_mask > 0,
                                    use_leave_one_out_baseline=g.use_leave_one_out_baseline,
                                    normalize_rewards=g.normalize_rewards)
        policy.train_step(batch, adv)
        engine.model.load_state_dict(policy.full_state_dict())
        times.append(time.perf_counter() - t0)
    return sum(times[WARMUP:]) / len(times[WARMUP:])


def through_services(cfg) -> float:
    with tempfile.TemporaryDirectory() as tmp, LocalStack(cfg, Path(tmp)) as stack:
        stack.start_services()
        steps = cfg.grpo.max_num_steps
        rows = stack.wait_for(lambda rows: len(rows) >= steps, f"{steps} steps", timeout_s=3600)[WARMUP:]
    return sum(r["timing/train/total_step_time"] for r in rows) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(None, [f"grpo.max_num_steps={args.steps}", "grpo.max_staleness=0", *args.overrides])
    direct = in_process(cfg)
    services = through_services(cfg)
    print(f"mean step, in one process : {direct:.3f} s")
    print(f"mean step, five services  : {services:.3f} s")
    print(f"overhead per step         : {services - direct:+.3f} s  (ratio {services / direct:.2f}x)")


if __name__ == "__main__":
    main()

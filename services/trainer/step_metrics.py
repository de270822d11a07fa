"""Per-step metrics read off the batch (pure): reward, staleness, lengths, rollout timings.

Names follow NeMo RL where it has one (train/reward, train/avg_trajectory_age, timing/train/...);
train/reward_mean and train/staleness_mean stay for the launcher's progress line and the benchmarks.
"""

from __future__ import annotations

from collections import defaultdict

from services.trainer.batch import TrainBatch


def step_metrics(step: int, batch: TrainBatch, groups) -> dict[str, float]:
    staleness = (step - batch.version_start).float()
    generated = batch.token_mask.sum(dim=1)
    out = {
        "train/reward": batch.rewards.mean().item(),  # NeMo RL's headline name
        "train/reward_mean": batch.rewards.mean().item(),
        "train/avg_trajectory_age": staleness.mean().item(),  # NeMo RL's name for the mean staleness
        "train/global_valid_toks": generated.sum().item(),
        "train/staleness_mean": staleness.mean().item(),
        "train/staleness_max": staleness.max().item(),
        "train/mean_gen_tokens_per_sample": generated.mean().item(),
        "train/truncation_rate": batch.truncated.float().mean().item(),
        "train/num_samples": float(len(batch)),
        # Rollout time spent on this batch (summed over its groups, whichever worker ran them).
        "timing/train/generation": sum(g.generation_seconds for g in groups),
        "timing/train/environment": sum(g.environment_seconds for g in groups),
    }
    by_env: dict[str, list[float]] = defaultdict(list)
    for env, reward in zip(batch.env_names, batch.rewards.tolist()):
        by_env[env].append(reward)
    for env, rewards in by_env.items():
        out[f"train/reward_mean/{env}"] = sum(rewards) / len(rewards)
    for name, values in batch.named_rewards.items():  # e.g. train/reward/correctness, as NeMo RL logs components
        out[f"train/{name}" if name.startswith("reward/") else f"train/reward/{name}"] = values.mean().item()
    return out

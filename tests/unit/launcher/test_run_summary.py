"""flywheel up's end-of-run summary (pure): the rollout's per-group times are not added into the step's time."""

from services.common.config import load_config
from services.local import summary_lines


def row(step: int, reward: float) -> dict:
    return {"step": step, "train/reward_mean": reward, "timing/train/total_step_time": 0.1,
            "timing/train/replay": 0.002, "timing/train/policy_training": 0.08, "timing/train/weight_sync": 0.006,
            # 16 groups generated together, each taking the batch's 0.04 s: summed, 0.64 s in a 0.1 s step
            "timing/train/generation": 16 * 0.04, "timing/train/environment": 16 * 0.01,
            "timing/train/rollout_span": 0.06, "timing/train/optimizer": 0.07}


def test_the_summary_gives_rollout_times_per_group_and_the_trainers_parts_apart():
    cfg = load_config(None, ["grpo.num_prompts_per_step=16"])
    lines = summary_lines(cfg, [row(s, 0.1 if s < 10 else 0.9) for s in range(20)])
    assert lines[1] == "  reward: first 10 steps 0.100 -> last 10 steps 0.900"
    assert lines[2] == "  mean step time 0.100 s; in the trainer: replay 0.002, training 0.080, weight sync 0.006 s"
    assert lines[3] == ("  rollout, mean per group (groups overlap one another and training): "
                        "generation 0.040, environment 0.010 s")
    assert lines[4] == "  step timeline: rollout 0.060, optimizer 0.070 s"
    assert not any("remainder" in line for line in lines)

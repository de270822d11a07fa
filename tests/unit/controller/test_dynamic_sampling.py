"""The pure parts of dynamic sampling: which groups are dropped, how many refills a step may take."""

from services.common.config import load_config
from services.common.pb.flywheel.v1 import types_pb2
from services.controller.replacements import refill_budget
from services.replay.validate import zero_variance


def _group(*rewards: float) -> types_pb2.TrajectoryGroup:
    return types_pb2.TrajectoryGroup(completions=[types_pb2.Completion(reward=r) for r in rewards])


def test_a_group_is_dropped_only_when_every_reward_is_the_same():
    assert zero_variance(_group(0, 0, 0)) and zero_variance(_group(1, 1)) and zero_variance(_group(0.5))
    assert not zero_variance(_group(0, 0, 1)) and not zero_variance(_group(1, 0.999))


def test_max_gen_batches_counts_the_first_batch():
    g = load_config(None, ["grpo.num_prompts_per_step=8", "grpo.dynamic_sampling_max_gen_batches=3"]).grpo
    assert refill_budget(g) == 16
    assert refill_budget(load_config(None, ["grpo.dynamic_sampling_max_gen_batches=1"]).grpo) == 0

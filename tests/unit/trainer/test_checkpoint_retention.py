"""keep_top_k retention as NeMo RL prunes: best periodic k by metric (recency without one), latest always kept."""

from services.common.config import CheckpointingConfig
from services.trainer.checkpoint import Saved, metric_value, to_delete


def saved(*pairs) -> list[Saved]:
    return [Saved(step=s, metric=m) for s, m in pairs]


def test_without_a_metric_the_newest_k_periodic_checkpoints_stay():
    cfg = CheckpointingConfig(save_period=10, keep_top_k=2)
    assert to_delete(saved((10, None), (20, None), (30, None), (40, None)), cfg) == [10, 20]


def test_best_k_by_metric_stay_and_the_latest_is_always_kept():
    cfg = CheckpointingConfig(save_period=10, keep_top_k=2, metric_name="train:reward_mean")
    steps = saved((10, 0.9), (20, 0.2), (30, 0.8), (40, 0.1))
    assert to_delete(steps, cfg) == [20]
    lower = CheckpointingConfig(save_period=10, keep_top_k=1, metric_name="train:loss", higher_is_better=False)
    assert to_delete(steps, lower) == [10, 20, 30]


def test_missing_metric_ranks_last_ties_prefer_newer_and_non_periodic_go():
    cfg = CheckpointingConfig(save_period=10, keep_top_k=1, metric_name="val:accuracy")
    assert to_delete(saved((10, 0.5), (20, 0.5), (25, None), (30, None)), cfg) == [10, 25]


def test_keep_top_k_null_keeps_every_periodic_checkpoint():
    cfg = CheckpointingConfig(save_period=10, keep_top_k=None)
    assert to_delete(saved((10, None), (15, None), (20, None), (23, None)), cfg) == [15]


def test_metric_names_map_to_the_step_s_metrics_or_its_validation():
    train = {"train/reward_mean": 0.5, "train/accuracy": 0.1}
    validation = {"validation/accuracy": 0.75, "validation/pass@4": 0.9}
    assert metric_value("train:reward_mean", train, validation, 4) == 0.5
    assert metric_value("val:accuracy", train, validation, 4) == 0.75
    assert metric_value("val:pass_k", train, validation, 4) == 0.9  # NeMo RL's pass_k is pass@n
    assert metric_value("val:accuracy", train, {}, 4) is None  # not validated: ranks last, as in NeMo RL
    assert metric_value("val:reward_mean", train, validation, 4) is None


def test_a_checkpoint_whose_validation_is_pending_stays_until_it_can_be_ranked():
    cfg = CheckpointingConfig(save_period=10, keep_top_k=1, metric_name="val:accuracy")
    # 30 is not validated yet: kept beside the best ranked (10) and the latest (40)
    steps = [Saved(step=10, metric=0.9), Saved(step=20, metric=0.2), Saved(step=30, metric=None, pending=True),
             Saved(step=40, metric=None, pending=True)]
    assert to_delete(steps, cfg) == [20]
    # once reported, 30 is ranked like the others
    steps[2] = Saved(step=30, metric=0.5)
    assert to_delete(steps, cfg) == [20, 30]

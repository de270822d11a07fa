"""checkpointing.checkpoint_must_save_by: the NeMo RL duration, and when the trainer stops (pure parts)."""

from __future__ import annotations

import pytest

from services.common.config import CheckpointingConfig, ConfigError, load_config
from services.trainer.main import out_of_time


def test_the_duration_is_days_hours_minutes_seconds():
    assert CheckpointingConfig(checkpoint_must_save_by="00:03:45:00").must_save_by_s == 3 * 3600 + 45 * 60
    assert CheckpointingConfig(checkpoint_must_save_by="2:00:00:07").must_save_by_s == 2 * 86400 + 7
    assert CheckpointingConfig().must_save_by_s is None


@pytest.mark.parametrize("value, message", [("3:45:00", "pattern"), ("00:03:45", "pattern"),
                                            (2160000, "quote the duration")])
def test_a_malformed_or_unquoted_duration_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        CheckpointingConfig(checkpoint_must_save_by=value)


def test_yaml_reads_an_unquoted_duration_from_ten_days_as_a_number_and_the_config_says_so():
    with pytest.raises(ConfigError, match="quote the duration"):
        load_config(None, ["checkpointing.checkpoint_must_save_by=10:00:00:00"])
    quoted = load_config(None, ["checkpointing.checkpoint_must_save_by='10:00:00:00'"])
    assert quoted.checkpointing.must_save_by_s == 10 * 86400


def test_the_trainer_stops_once_one_more_mean_step_would_pass_the_limit():
    assert not out_of_time(None, 10**9, 1.0)
    assert not out_of_time(100.0, 60.0, 20.0)  # the next step ends at 80 s
    assert out_of_time(100.0, 80.0, 20.0)  # the next one would end at 100 s
    assert out_of_time(100.0, 101.0, 0.1)

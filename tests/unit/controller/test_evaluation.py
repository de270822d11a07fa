"""pass@k against its closed form, the validation schedule, and metrics in TensorBoard event files."""

import math
import random

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.common.config import load_config
from services.controller.evaluation import PromptResult, pass_at_k, summarize
from services.controller.tracking import Tracker, tensorboard_dir


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def brute_force(n: int, c: int, k: int) -> float:
    """The definition: the fraction of k-subsets of n samples (c correct) holding a correct one."""
    from itertools import combinations
    subsets = list(combinations([i < c for i in range(n)], k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("seed", range(20))
def test_pass_at_k_matches_the_closed_form(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 200)
    c, k = rng.randint(0, n), rng.randint(1, n)
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(5, 2, 2), (6, 1, 3), (4, 0, 2), (4, 4, 1), (7, 3, 7)])
def test_pass_at_k_is_the_chance_that_k_draws_hold_a_correct_sample(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(3, 4, 1), (3, 1, 0), (3, 1, 4)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_summary_averages_pass_at_k_over_prompts_and_accuracy_over_samples():
    results = [PromptResult(prompt="a", rewards=[1.0, 0.0], lengths=[3, 5], version=4),
               PromptResult(prompt="b", rewards=[0.0, 0.0], lengths=[2, 2], version=5)]
    m = summarize(results, 2)
    assert m["validation/accuracy"] == 0.25 and m["validation/avg_length"] == 3.0
    assert m["validation/pass@2"] == 0.5 and m["validation/policy_version"] == 4
    assert m["validation/failed_prompts"] == 0


def test_a_failed_prompt_is_counted_and_left_out_and_all_failed_is_an_error():
    good = PromptResult(prompt="a", rewards=[1.0, 0.0], lengths=[3, 5], version=4)
    failed = PromptResult(prompt="b", error="FAILED_PRECONDITION: an agent episode failed 3 times: crash: exit 3")
    m = summarize([good, failed], 2)
    assert m["validation/accuracy"] == 0.5 and m["validation/num_prompts"] == 1
    assert m["validation/failed_prompts"] == 1 and m["validation/pass@2"] == 1.0
    with pytest.raises(RuntimeError, match="every one of 1 validation prompts failed.*crash: exit 3"):
        summarize([failed], 2)


def test_validation_schedule_follows_nemo_rl_keys():
    cfg = load_config(None, ["grpo.val_period=3", "grpo.val_start_at=5", "grpo.val_at_start=true",
                             "grpo.val_at_end=true"])
    assert [v for v in range(12) if cfg.grpo.validation_due(v, final=False)] == [0, 6, 9]
    assert cfg.grpo.validation_due(11, final=True)
    assert not load_config(None, ["grpo.val_period=3"]).grpo.validation_due(11, final=True)


def test_tracker_writes_tensorboard_event_files_without_torch(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    tracker = Tracker(cfg)
    tracker.log({"validation/accuracy": 0.25, "train/reward": 0.5}, step=3)
    tracker.log({"validation/accuracy": 0.75}, step=6)
    tracker.close()
    acc = EventAccumulator(str(tensorboard_dir(cfg)))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("validation/accuracy")] == [(3, 0.25), (6, 0.75)]
    assert tensorboard_dir(cfg) == tmp_path / "logs" / "tensorboard"


def test_controller_modules_import_no_torch():
    import subprocess
    import sys
    code = ("import sys, services.controller.main, services.controller.evaluation, services.controller.tracking; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

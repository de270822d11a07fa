"""grpo.stop_at_validation_metric: which reported validation ends the run (pure; the run itself:
tests/integration/test_early_stop_e2e.py)."""

from services.common.config import GRPOConfig
from services.trainer.main import reached_threshold


def test_the_earliest_validation_at_or_above_the_threshold_ends_the_run():
    grpo = GRPOConfig(val_period=2, stop_at_validation_metric="accuracy", stop_at_validation_threshold=0.5)
    validated = {6: {"validation/accuracy": 0.7}, 2: {"validation/accuracy": 0.1}, 4: {"validation/accuracy": 0.5}}
    assert reached_threshold(validated, grpo) == (4, 0.5)  # >=, as in NeMo RL
    assert reached_threshold({2: {"validation/accuracy": 0.49}}, grpo) is None
    assert reached_threshold({}, grpo) is None


def test_pass_k_is_read_as_pass_at_n():
    grpo = GRPOConfig(val_period=2, val_num_generations_per_prompt=4, stop_at_validation_metric="pass_k",
                      stop_at_validation_threshold=0.9)
    assert reached_threshold({2: {"validation/accuracy": 0.95, "validation/pass@4": 0.8}}, grpo) is None
    assert reached_threshold({2: {"validation/pass@4": 0.9}}, grpo) == (2, 0.9)

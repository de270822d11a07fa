"""A run that cannot go on stops, with its reason, instead of being restarted into the same failure."""

from __future__ import annotations

import re

import pytest

from services.common.config import load_config
from services.local import LocalStack, read_restarts

pytestmark = pytest.mark.slow


def test_dynamic_sampling_out_of_batches_stops_the_run_and_nothing_is_restarted(tmp_path):
    """The toy task starts near reward 0.03, so most 16-sample groups score all zeros. With one batch of prompts
    allowed per step, the first filtered group leaves step 0 short: the controller must end the run."""
    cfg = load_config(None, ["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=1"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        with pytest.raises(RuntimeError) as err:
            stack.wait_for(lambda rows: False, "the run to stop", timeout_s=300)
    message = str(err.value)
    assert message.startswith("controller stopped the run (exit 78)"), message
    assert re.search(r"the run cannot go on: dynamic sampling: step \d+ needed more than "
                     r"grpo.dynamic_sampling_max_gen_batches=1 batches", message), message
    assert read_restarts(tmp_path) == []

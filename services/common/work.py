"""What an environment spec, and so each prompt group leased from it, may ask of rollout: sampling overrides,
turns per episode and a reward scale. Checked where a spec enters (the controller's SubmitEnvironment and the
config's environments) and again where a work item or a Generate request reaches rollout, since a message on
the work queue need not come from the controller. Torch-free."""

from __future__ import annotations

import math

from services.common.errors import require
from services.common.pb.flywheel.v1 import types_pb2

MIN_TEMPERATURE = 1e-5
"""Below it, logits / T overflow to inf and sampling fails (vLLM samples greedily there)."""
MAX_TURNS = 1000


def check_sampling(s: types_pb2.SamplingParams, where: str = "sampling") -> None:
    """The overrides as the engines accept them (zero = the configured default)."""
    require(s.max_new_tokens >= 0, f"{where}.max_new_tokens must be >= 0, got {s.max_new_tokens}")
    require(s.temperature == 0 or MIN_TEMPERATURE <= s.temperature < math.inf,
            f"{where}.temperature must be 0 (the default) or in [{MIN_TEMPERATURE:g}, inf), got {s.temperature}")
    require(0 <= s.top_p <= 1, f"{where}.top_p must be in [0, 1], got {s.top_p}")
    require(s.top_k >= 0, f"{where}.top_k must be >= 0, got {s.top_k}")
    require(all(s.stop_strings), f"{where}.stop_strings must not contain an empty string")


def check_episodes(max_turns: int, reward_scale: float, where: str = "") -> None:
    """Turns per episode (0 = the configured default) and the factor every reward is multiplied by (0 = 1): a
    non-finite scale would make every reward of the group NaN or inf, and the trainer's weights with them."""
    require(0 <= max_turns <= MAX_TURNS, f"{where}max_turns must be in 0..{MAX_TURNS}, got {max_turns}")
    require(math.isfinite(reward_scale) and reward_scale >= 0, f"{where}reward_scale must be >= 0, got {reward_scale}")

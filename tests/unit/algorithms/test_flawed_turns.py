"""NeMo RL's advantage overrides for flawed turns, against a slow reference that walks each sample's message log as
NeMo RL's `_apply_message_level_advantage_penalties` does (read at 7ea279a): messages in order, an assistant one
flagged invalid gets the invalid value over its tokens, else one flagged malformed the malformed value."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from services.common.config import GRPOConfig
from services.trainer.algorithms import flawed_turn_advantages
from services.trainer.batch import batch_advantages, build_batch

INVALID, MALFORMED = 1, 2


def message_log(rng: random.Random) -> list[dict]:
    """A sample as NeMo RL's message log: user (prompt, tool results) and assistant messages, flags on the latter."""
    log = [{"role": "user", "n": rng.randrange(1, 4)}]
    for _ in range(rng.randrange(1, 4)):
        flaws = rng.choice([0, 0, INVALID, MALFORMED, INVALID | MALFORMED])
        log.append({"role": "assistant", "n": rng.randrange(1, 4), "is_invalid_tool_call": bool(flaws & INVALID),
                    "has_malformed_thinking": bool(flaws & MALFORMED)})
        log.append({"role": "user", "n": rng.randrange(1, 3)})
    return log


def reference(logs: list[list[dict]], advantage: list[float], width: int, invalid, malformed):
    out = torch.tensor(advantage, dtype=torch.float32)[:, None].repeat(1, width)
    counts = {"invalid": 0, "malformed": 0, "assistant": 0}
    for i, log in enumerate(logs):
        offset = 0
        for m in log:
            if m["role"] == "assistant":
                counts["assistant"] += 1
                if invalid is not None and m["is_invalid_tool_call"]:
                    counts["invalid"] += 1
                    out[i, offset:offset + m["n"]] = invalid
                elif malformed is not None and m["has_malformed_thinking"]:
                    counts["malformed"] += 1
                    out[i, offset:offset + m["n"]] = malformed
            offset += m["n"]
    return out, counts


def tensors(logs: list[list[dict]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_mask and flaws as the batch holds them: per token, generated and the turn's TurnFlaw bits."""
    mask, flaws = torch.zeros(len(logs), width), torch.zeros(len(logs), width, dtype=torch.uint8)
    for i, log in enumerate(logs):
        offset = 0
        for m in log:
            if m["role"] == "assistant":
                mask[i, offset:offset + m["n"]] = 1
                flaws[i, offset:offset + m["n"]] = INVALID * m["is_invalid_tool_call"] | (
                    MALFORMED * m["has_malformed_thinking"])
            offset += m["n"]
    return mask, flaws


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("invalid, malformed", [(-5.0, -7.0), (-5.0, None), (None, -3.0)])
def test_overrides_match_nemo_rls_message_loop(seed, invalid, malformed):
    rng = random.Random(seed)
    logs = [message_log(rng) for _ in range(rng.randrange(1, 5))]
    width = max(sum(m["n"] for m in log) for log in logs) + rng.randrange(0, 3)  # padding
    advantage = [rng.uniform(-2, 2) for _ in logs]
    mask, flaws = tensors(logs, width)
    got, metrics = flawed_turn_advantages(torch.tensor(advantage), mask, flaws, invalid_tool_call=invalid,
                                          malformed_thinking=malformed)
    want, counts = reference(logs, advantage, width, invalid, malformed)
    assert torch.equal(got * mask, want * mask)  # the loss reads loss tokens only
    assert metrics["num_invalid_tool_calls"] == counts["invalid"]
    assert metrics["num_malformed_thinking"] == counts["malformed"]
    assert metrics["num_assistant_messages"] == counts["assistant"]
    assert metrics["invalid_tool_call_rate"] == pytest.approx(counts["invalid"] / counts["assistant"])


def completion(tokens: int, flaws: list[int]):
    return SimpleNamespace(token_ids=[5] * tokens, generated_mask=[True] * tokens,
                           generation_logprobs=[-1.0] * tokens, reward=float(bool(flaws)), version_start=0,
                           truncated=False, named_rewards={}, flaws=flaws)


def test_the_batch_puts_each_tokens_flaws_on_the_target_it_is():
    """A completion's token t is target len(prompt) + t - 1; its flaws go there, padding and prompt get none."""
    group = SimpleNamespace(prompt_token_ids=[1, 2, 3], prompt_id="p", env_name="agent",
                            completions=[completion(3, [1, 0, 2]), completion(2, [])])
    b = build_batch([group], pad_id=0)
    assert b.flaws.tolist() == [[0, 0, 1, 0, 2], [0, 0, 0, 0, 0]]
    assert b.token_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 0]]


def test_batch_advantages_override_only_when_configured():
    group = SimpleNamespace(prompt_token_ids=[1, 2], prompt_id="p", env_name="agent",
                            completions=[completion(2, [1, 1]), completion(2, [])])
    b = build_batch([group], pad_id=0)
    plain, metrics = batch_advantages(b, GRPOConfig())
    assert plain.dim() == 1 and "num_invalid_tool_calls" not in metrics
    got, metrics = batch_advantages(b, GRPOConfig(invalid_tool_call_advantage=-5.0))
    assert got[0, 1:].tolist() == [-5.0, -5.0]  # the flawed turn's targets
    assert torch.equal(got[1], plain[1].expand(3))
    assert metrics["num_invalid_tool_calls"] == 1 and metrics["num_assistant_messages"] == 2

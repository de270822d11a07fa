"""NeMo RL's advantage overrides for flawed assistant turns (`grpo.invalid_tool_call_advantage`,
`grpo.malformed_thinking_advantage`; its grpo.py `_apply_message_level_advantage_penalties`, read at 7ea279a).

Every loss token of a turn the endpoint flagged (Completion.flaws, services/rollout/flaws.py) gets the
configured advantage in place of its sample's, whatever the estimator gave; where a turn has both flaws the invalid
tool call's value wins, as in NeMo RL. A turn is a run of consecutive loss tokens: the endpoint's replies are
separated by the prompt tokens between them (tool results, the template's turn markers), and each is NeMo RL's
assistant message. The metrics count turns under NeMo RL's names.
"""

from __future__ import annotations

import torch
from torch import Tensor

INVALID_TOOL_CALL = 1
"""TurnFlaw's bits (proto/flywheel/v1/types.proto), which tests check against the proto."""
MALFORMED_THINKING = 2


def flawed_turn_advantages(advantages: Tensor, token_mask: Tensor, flaws: Tensor, *,
                           invalid_tool_call: float | None, malformed_thinking: float | None
                           ) -> tuple[Tensor, dict[str, float]]:
    """advantages [B] (or [B, T]), token_mask [B, T], flaws [B, T] TurnFlaw bits per target token ->
    per-token advantages [B, T] and NeMo RL's penalty metrics."""
    out = (advantages if advantages.dim() == 2 else advantages[:, None]).expand(token_mask.shape).clone()
    turn = token_mask > 0
    none = torch.zeros_like(turn)
    invalid = turn & (flaws & INVALID_TOOL_CALL).bool() if invalid_tool_call is not None else none
    malformed = turn & (flaws & MALFORMED_THINKING).bool() & ~invalid if malformed_thinking is not None else none
    if invalid_tool_call is not None:
        out[invalid] = invalid_tool_call
    if malformed_thinking is not None:
        out[malformed] = malformed_thinking
    first = turn & ~torch.nn.functional.pad(turn[:, :-1], (1, 0))  # each turn's first token
    turns = int(first.sum())
    n_invalid, n_malformed = int((first & invalid).sum()), int((first & malformed).sum())
    return out, {"invalid_tool_call_rate": n_invalid / max(turns, 1),
                 "malformed_thinking_rate": n_malformed / max(turns, 1),
                 "num_invalid_tool_calls": float(n_invalid), "num_malformed_thinking": float(n_malformed),
                 "num_assistant_messages": float(turns)}

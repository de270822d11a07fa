"""The "toy_copy" environment: the toy task of the local default run ("copy 3" -> answer "3").

Small enough for a tiny random-init transformer with a character-level tokenizer to learn within about
100 GRPO steps on CPU: digits are drawn from 0..4, so that once the policy has learnt to answer with a
digit at all, one in five answers is already right and the copy behaviour gets a signal early.
Reward 1.0 iff the first non-whitespace character of the newest assistant message is the ground-truth
digit. Single-turn; prompts() generates the data.
"""

from __future__ import annotations

import random

from services.environment.base import Environment, StepResult, last_assistant, score_each

DIGITS = 5
"""Prompts ask to copy one of the digits 0 .. DIGITS-1."""


class ToyCopyEnvironment(Environment):
    kind = "toy_copy"

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        def one(conversation, meta):
            text = last_assistant(conversation).lstrip()
            first = text[0] if text else None
            correct = first is not None and first == str(meta["ground_truth"])
            return StepResult(
                observation="Environment: correct" if correct else "Environment: incorrect",
                reward=1.0 if correct else 0.0,
                answer=first if return_extracted_answer else None,
            )

        return score_each(one, conversations, metadata)

    def prompts(self, count: int, seed: int, offset: int) -> list[dict]:
        rows = []
        for index in range(offset, offset + count):
            digit = random.Random(f"toy_copy:{seed}:{index}").randrange(DIGITS)
            rows.append({"messages": [{"role": "user", "content": f"copy {digit}"}],
                         "metadata": {"ground_truth": str(digit)}})
        return rows

"""The "exact_match" environment: the answer must equal metadata["ground_truth"] after normalisation.

The answer is the content of the last <answer>...</answer> in the newest assistant message, else of its
last \\boxed{...} (braces balanced), else the whole message. Both sides are normalised: stripped,
case-folded, and with runs of whitespace collapsed to one space. Reward 1.0 on a match. Single-turn.
"""

from __future__ import annotations

import re

from services.environment.base import Environment, StepResult, last_assistant, score_each

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED = "\\boxed{"


class ExactMatchEnvironment(Environment):
    kind = "exact_match"

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        def one(conversation, meta):
            answer = extract_answer(last_assistant(conversation))
            correct = normalize(answer) == normalize(str(meta["ground_truth"]))
            return StepResult(
                observation="Environment: correct" if correct else "Environment: incorrect",
                reward=1.0 if correct else 0.0,
                answer=answer if return_extracted_answer else None,
            )

        return score_each(one, conversations, metadata)


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def extract_answer(text: str) -> str:
    """The last <answer> content, else the last \\boxed{} content, else the text itself."""
    tagged = ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    boxed = last_boxed(text)
    return text if boxed is None else boxed


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} whose braces balance; None when there is none."""
    start = text.rfind(BOXED)
    while start != -1:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED):i - 1]
        start = text.rfind(BOXED, 0, start)
    return None

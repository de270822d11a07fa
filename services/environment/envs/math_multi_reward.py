"""The "math_multi_reward" environment: three reward components for GDPO, as NeMo RL's MathMultiRewardEnvironment.

The response is every assistant message joined; its answer is the text between the last "<answer>" and the
first "</answer>" after it, stripped (the whole response when it has no tag). Components, each 0.0 or 1.0:

    reward/correctness  the answer equals metadata["ground_truth"] (as strings)
    reward/integer      the answer is all digits
    reward/format       the whole response is "<think>...</think>\\n<answer>...</answer>", one answer tag each

The episode's reward is their sum, as NeMo RL's rollout totals a dict of rewards. String checks only, so it
runs in the environment's own process. Single-turn.
"""

from __future__ import annotations

import re

from services.environment.base import Environment, StepResult, assistant_contents, score_each
from services.environment.envs.math import CORRECT, INCORRECT

FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)


def answer_of(response: str) -> str:
    return response.split("<answer>")[-1].split("</answer>")[0].strip()


def components(response: str, ground_truth: str) -> dict[str, float]:
    answer = answer_of(response)
    well_formed = bool(FORMAT.search(response)) and response.count("<answer>") == response.count("</answer>") == 1
    return {"reward/correctness": float(answer == ground_truth), "reward/integer": float(answer.isdigit()),
            "reward/format": float(well_formed)}


class MathMultiRewardEnvironment(Environment):
    kind = "math_multi_reward"

    def __init__(self, num_workers: int = 1, math_verify_impl: str = "hf_math_verify") -> None:
        if math_verify_impl != "hf_math_verify":
            raise ValueError(f"math_multi_reward's math_verify_impl is hf_math_verify only, got {math_verify_impl!r}")
        del num_workers  # NeMo RL's verifier actors; string checks need none

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        def one(conversation: list[dict], meta: dict) -> StepResult:
            response = "".join(assistant_contents(conversation))
            named = components(response, str(meta["ground_truth"]))
            return StepResult(observation=CORRECT if named["reward/correctness"] else INCORRECT,
                              reward=sum(named.values()), named_rewards=named,
                              answer=answer_of(response) if return_extracted_answer else None)

        return score_each(one, conversations, metadata)

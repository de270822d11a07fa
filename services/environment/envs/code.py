"""The "code" environment: runs the last assistant message's Python against metadata["tests"] in a sandbox.

The program is the last ```python (or ```py) fenced block of the newest assistant message, or else its
last <code>...</code> block. metadata["tests"] holds Python asserts (a string, or a list of strings joined
by newlines) that run after the program in the same namespace. Reward is 1.0 iff every test passes.
Single-turn. A program that fails an assert is an ordinary wrong answer (`error` empty); a program the
sandbox had to stop or refuse (timeout, memory, network, ...) sets `error`. See `sandbox.py`.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from services.environment.base import Environment, StepResult, last_assistant
from services.environment.envs.sandbox import SandboxLimits, SandboxOutcome, run_python

FENCED = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
CODE_TAG = re.compile(r"<code>(.*?)</code>", re.DOTALL)


class CodeEnvironment(Environment):
    kind = "code"

    def __init__(self, limits: SandboxLimits | None = None, max_parallel: int | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.max_parallel = max_parallel or os.cpu_count() or 1
        """Sandboxes run at once by this environment, whatever the calls: rollout sends the episodes of the
        groups that score together in one Step, so a bound per call would shrink as calls merge."""
        self._pool = ThreadPoolExecutor(max_workers=self.max_parallel, thread_name_prefix="code-sandbox")

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        if len(conversations) != len(metadata):
            raise ValueError(f"{len(conversations)} conversations but {len(metadata)} metadata entries")
        results = list(self._pool.map(self._one, conversations, metadata))
        if not return_extracted_answer:
            for result in results:
                result.answer = None
        return results

    def _one(self, conversation: list[dict], meta: dict) -> StepResult:
        try:
            program = extract_program(last_assistant(conversation))
            if program is None:
                return StepResult.failed("no code block", observation="Environment: no code block found")
            outcome = run_python(program, _tests(meta), self.limits)
        except Exception as exc:  # noqa: BLE001 - on purpose: one bad episode never fails the batch
            return StepResult.failed(f"{type(exc).__name__}: {exc}")
        return StepResult(
            observation=_observation(outcome),
            reward=1.0 if outcome.passed else 0.0,
            error=outcome.error,
            answer=program,
        )


def extract_program(text: str) -> str | None:
    """The last fenced python block, else the last <code> block, else None."""
    for pattern in (FENCED, CODE_TAG):
        blocks = pattern.findall(text)
        if blocks:
            return blocks[-1]
    return None


def _tests(meta: dict) -> str:
    tests = meta["tests"]
    if isinstance(tests, list):
        return "\n".join(str(t) for t in tests)
    if not isinstance(tests, str):
        raise TypeError(f'metadata["tests"] must be a string or a list of strings, '
                        f'not {type(tests).__name__}')
    return tests


def _observation(outcome: SandboxOutcome) -> str:
    if outcome.passed:
        return "Environment: tests passed"
    reason = outcome.error or outcome.detail or "unknown"
    return f"Environment: tests failed ({reason})"

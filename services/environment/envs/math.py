"""The "math" environment: math_verify against metadata["ground_truth"], as NeMo RL's MathEnvironment.

The response is every assistant message joined, so multi-turn answers count. The ground truth is
wrapped in \\boxed{} and extracted as LaTeX; the response is extracted as a plain expression or LaTeX.
Reward is 1.0 when any extracted prediction verifies against the gold, else 0.0. Single-turn.
With math_verify_impl "dapo_math_verify", DAPO's "Answer: ..." string check replaces math_verify (dapo_math.py).

Where it runs: math_verify bounds sympy with signal.alarm, which works only on a main thread, and
responses such as \\boxed{9^{9^{9^9}}} run sympy for ever (holding the GIL) without that bound. So a
call from the main thread verifies in-process, and a call from any other thread (the servicer steps in
`asyncio.to_thread`) goes to a pool of spawned worker processes that verify on their own main thread,
with the alarm, as NeMo RL's verifier actors do.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from math_verify.errors import TimeoutException
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

from services.environment.base import Environment, StepResult, assistant_contents
from services.environment.envs.dapo_math import dapo_verify

CORRECT = "Environment: correct"
INCORRECT = "Environment: incorrect"
_metric = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                      pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
Verdict = tuple[float, tuple[list[str], list[str]] | None]
"""(score 0.0|1.0, (extracted golds, extracted predictions) or None), as math_metric returns."""


def verify_response(ground_truth: str, response: str) -> Verdict:
    """math_metric on the boxed ground truth; raises math_verify's TimeoutException past its alarm."""
    return _metric(["\\boxed{" + ground_truth + "}"], [response])


class MathEnvironment(Environment):
    kind = "math"

    def __init__(self, num_workers: int = 2, worker_deadline_s: float = 60.0,
                 math_verify_impl: str = "hf_math_verify") -> None:
        if math_verify_impl not in ("hf_math_verify", "dapo_math_verify"):
            raise ValueError(f"math_verify_impl must be hf_math_verify or dapo_math_verify, got {math_verify_impl!r}")
        self.dapo = math_verify_impl == "dapo_math_verify"
        """DAPO's string check (envs/dapo_math.py) instead of math_verify; it needs no worker processes."""
        self.num_workers = num_workers
        """Verifier processes used when step() is called off the main thread."""
        self.worker_deadline_s = worker_deadline_s
        """Seconds to wait for one verdict from a worker (math_verify's own alarms total ~20 s)."""
        self._pool: ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def step(self, conversations, metadata, *, return_extracted_answer=False):
        jobs = _jobs(conversations, metadata)
        if self.dapo:
            results = [_dapo_result(*job) if isinstance(job, tuple) else job for job in jobs]
        elif threading.current_thread() is threading.main_thread():
            results = [_result(_in_process(job)) if isinstance(job, tuple) else job for job in jobs]
        else:
            results = [_result(v) for v in self._in_workers(jobs)]
        if not return_extracted_answer:
            for result in results:
                result.answer = None
        return results

    def close(self) -> None:
        """Stops the worker processes, if any were started."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def _in_workers(self, jobs: list) -> list:
        pool = self._worker_pool()
        futures = [pool.submit(verify_response, *job) if isinstance(job, tuple) else job for job in jobs]
        verdicts = []
        for future in futures:
            if isinstance(future, StepResult):
                verdicts.append(future)
                continue
            try:
                verdicts.append(future.result(timeout=self.worker_deadline_s))
            except FutureTimeout:
                verdicts.append(StepResult.failed("verifier timeout", observation=INCORRECT))
            except BrokenProcessPool as exc:  # a worker died (e.g. OOM): start afresh next call
                self.close()
                verdicts.append(StepResult.failed(f"verifier crashed: {exc}", observation=INCORRECT))
            except BaseException as exc:  # TimeoutException is a BaseException
                verdicts.append(_failure(exc))
        return verdicts

    def _worker_pool(self) -> ProcessPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                # spawn, never fork: the caller is a threaded gRPC server.
                spawn = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(self.num_workers, mp_context=spawn)
            return self._pool


def _jobs(conversations: list[list[dict]], metadata: list[dict]) -> list[tuple[str, str] | StepResult]:
    """(ground truth, joined assistant text) per episode, or the failure of a malformed episode."""
    if len(conversations) != len(metadata):
        raise ValueError(f"{len(conversations)} conversations but {len(metadata)} metadata entries")
    jobs = []
    for conversation, meta in zip(conversations, metadata):
        try:
            jobs.append((str(meta["ground_truth"]), "".join(assistant_contents(conversation))))
        except Exception as exc:  # on purpose: one bad episode never fails the batch
            jobs.append(StepResult.failed(f"bad episode: {type(exc).__name__}: {exc}"))
    return jobs


def _in_process(job: tuple[str, str]) -> Verdict | StepResult:
    try:
        return verify_response(*job)
    except BaseException as exc:  # TimeoutException is a BaseException; anything else is one bad episode
        if not isinstance(exc, (Exception, TimeoutException)):
            raise
        return _failure(exc)


def _failure(exc: BaseException) -> StepResult:
    if isinstance(exc, TimeoutException):
        return StepResult.failed("verifier timeout", observation=INCORRECT)
    return StepResult.failed(f"verifier error: {type(exc).__name__}: {exc}", observation=INCORRECT)


def _dapo_result(ground_truth: str, response: str) -> StepResult:
    reward, prediction = dapo_verify(response, ground_truth)
    return StepResult(observation=CORRECT if reward > 0 else INCORRECT, reward=reward, answer=prediction)


def _result(verdict: Verdict | StepResult) -> StepResult:
    if isinstance(verdict, StepResult):  # a failure of math_verify itself
        return verdict
    score, extracted = verdict
    reward = float(score)
    return StepResult(observation=CORRECT if reward > 0 else INCORRECT, reward=reward,
                      answer=_extracted_answer(extracted))


def _extracted_answer(extracted: tuple[list[str], list[str]] | None) -> str | None:
    """The first prediction equal to a gold, else the first prediction, else None."""
    if not extracted:
        return None
    golds, preds = extracted
    for pred in preds:
        if pred in golds:
            return pred
    return preds[0] if preds else None

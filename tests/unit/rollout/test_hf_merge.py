"""The hf engine merges calls that wait while a batch runs, when they sample alike, and splits the results back."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.config import load_config
from services.rollout.engines import Sampling
from services.rollout.engines.hf import HFEngine


@pytest.fixture(scope="module")
def engine():
    return HFEngine(load_config(None, ["policy.max_total_sequence_length=32"]), "merge-test")


def _count_batches(engine, monkeypatch) -> list[int]:
    rows: list[int] = []
    inner = engine._generate

    def counted(prompts, sampling):
        rows.append(len(prompts))
        return inner(prompts, sampling)

    monkeypatch.setattr(engine, "_generate", counted)
    return rows


async def test_alike_calls_share_a_batch_and_each_gets_its_own_rows(engine, monkeypatch):
    rows = _count_batches(engine, monkeypatch)
    sampling = Sampling(max_new_tokens=3)
    prompts = [[[1, 5 + i]] * (i + 1) for i in range(4)]  # 1, 2, 3, 4 rows
    outs = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    assert [len(o) for o in outs] == [1, 2, 3, 4]
    assert all(0 < len(g.token_ids) <= 3 and len(g.logprobs) == len(g.token_ids) for o in outs for g in o)
    assert sum(rows) == 10 and len(rows) < 4


async def test_seeded_calls_other_settings_and_calls_that_would_lose_budget_run_alone(engine, monkeypatch):
    rows = _count_batches(engine, monkeypatch)
    short, long = [[1, 5]], [[1] + [5] * 29]  # 32 - 30 = 2 tokens of room left next to the long prompt
    calls = [(short, Sampling(max_new_tokens=3, seed=1)), (short, Sampling(max_new_tokens=3, seed=1)),
             (short, Sampling(max_new_tokens=3, temperature=0.5)), (short, Sampling(max_new_tokens=3)),
             (long, Sampling(max_new_tokens=3))]
    outs = await asyncio.gather(*(engine.generate(p, s) for p, s in calls))
    assert rows == [1] * 5
    assert outs[0][0].token_ids == outs[1][0].token_ids  # a seed still fixes its call's rows
    assert len(outs[3][0].token_ids) > 0 and len(outs[4][0].token_ids) <= 2  # the long one kept its own budget


async def test_the_next_batch_waits_for_the_callers_of_the_last_one(engine, monkeypatch):
    """A call that arrives alone runs alone, and calls arriving meanwhile wait. When its caller comes back
    (a rollout worker's next group), the next batch takes it with them, rather than the waiting calls running
    without it and it alone after them, a batch per group instead of one for all (the worker's groups would
    never fall in step again)."""
    rows: list[int] = []
    inner = engine._generate

    def slow(prompts, sampling):  # long enough that the other calls arrive while it runs
        rows.append(len(prompts))
        time.sleep(0.1)
        return inner(prompts, sampling)

    monkeypatch.setattr(engine, "_generate", slow)
    monkeypatch.setattr(engine, "_active", 0)
    sampling = Sampling(max_new_tokens=3)

    async def first() -> None:
        await engine.generate([[1, 5]], sampling)
        await engine.generate([[1, 6]], sampling)  # comes back once answered

    task = asyncio.create_task(first())
    while not rows:  # its batch runs
        await asyncio.sleep(0.001)
    others = [asyncio.create_task(engine.generate([[1, 7 + i]], sampling)) for i in range(3)]
    await asyncio.gather(task, *others)
    assert rows == [1, 4]

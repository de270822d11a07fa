"""The teacher server's Batcher (services/rollout/teacher.py): requests that arrive together share forwards, and
each gets back exactly its own rows' top-k, as a lone call of the same rows gives."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.common.config import load_config
from services.rollout.teacher import Batcher, Teacher, load_teacher
from services.rollout.teacher_topk import Row

K = 3


class RecordingTeacher(Teacher):
    """The real Teacher, which also records how many rows each score call (one batch) was given."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def score(self, rows):
        self.batches.append(len(rows))
        return super().score(rows)


@pytest.fixture(scope="module")
def model():
    return load_teacher(load_config(None, ["++distillation={}", "teacher.model_name=tiny",
                                           f"distillation.topk_logits_k={K}"]))


def _requests(vocab: int) -> list[list[Row]]:
    rng = random.Random(0)
    return [[Row(ids=[rng.randrange(vocab) for _ in range(p + n)], n=n) for n in sizes]
            for p, sizes in ((4, (3, 5)), (7, (1,)), (2, (6, 0, 2)))]


@pytest.mark.parametrize("max_tokens, batches", [(10_000, [6]), (1, [2, 1, 3])])
async def test_concurrent_requests_share_batches_up_to_the_bound_and_each_gets_its_own_rows(model, max_tokens, batches):
    teacher = RecordingTeacher(model, k=K, max_len=64, max_batch_tokens=10_000)
    batcher = Batcher(teacher, wait_s=0.2, max_tokens=max_tokens)
    requests = _requests(teacher.vocab_size)
    got = await asyncio.gather(*(batcher.score(rows) for rows in requests))
    assert teacher.batches == batches
    for rows, answer in zip(requests, got, strict=True):
        alone = Teacher.score(teacher, rows)
        assert len(answer) == len(rows)
        for (values, ids), (want_v, want_i), row in zip(answer, alone, rows, strict=True):
            assert values.shape == (row.n, K)
            assert torch.equal(ids, want_i)
            torch.testing.assert_close(values, want_v, rtol=0, atol=1e-5)

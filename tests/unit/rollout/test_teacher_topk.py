"""The teacher's top-k (services/rollout/teacher_topk.py, teacher.py) against a slow reference: one unpadded
forward per sequence, and a Python loop over each position's full logits."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.rollout.teacher import Teacher, load_teacher
from services.rollout.teacher_topk import Row, check_request, chunks, completion_topk

K = 5


def slow_topk(position_logits: list[float], k: int) -> tuple[list[float], list[int]]:
    order = sorted(range(len(position_logits)), key=lambda v: -position_logits[v])[:k]
    return [position_logits[v] for v in order], order


def reference(model, prompt: list[int], completion: list[int], k: int) -> tuple[list, list]:
    """Row t: the top-k of the logits at absolute position len(prompt) + t - 1, the one that predicts token t."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    values, ids = [], []
    for t in range(len(completion)):
        v, i = slow_topk(logits[len(prompt) + t - 1].tolist(), k)
        values.append(v)
        ids.append(i)
    return values, ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_completion_topk_matches_a_loop_over_every_positions_logits(seed):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows = [Row(ids=[0] * rng.randint(3, 9), n=rng.randint(0, 3)) for _ in range(4)]
    logits = torch.randn(len(rows), 12, 17, generator=g)
    got = completion_topk(logits, rows, K)
    for i, row in enumerate(rows):
        values, ids = got[i]
        assert values.shape == ids.shape == (row.n, K)
        prompt_len = len(row.ids) - row.n
        for t in range(row.n):  # completion token t is predicted at position prompt_len + t - 1
            want_v, want_i = slow_topk(logits[i, prompt_len + t - 1].tolist(), K)
            assert values[t].tolist() == want_v
            assert ids[t].tolist() == want_i


def test_completion_topk_reads_kept_logits_from_their_offset():
    logits = torch.randn(2, 10, 11)
    rows = [Row(ids=list(range(7)), n=3), Row(ids=list(range(10)), n=4)]
    full = completion_topk(logits, rows, K)
    kept = completion_topk(logits[:, 3:], rows, K, offset=3)  # both rows start at 3 or later
    for (a, b), (c, d) in zip(full, kept, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_chunks_keep_each_forward_within_the_token_budget_and_the_row_order():
    rows = [Row(ids=[1] * n, n=1) for n in (4, 6, 3, 9, 2, 2)]
    parts = chunks(rows, 12)
    assert [r for part in parts for r in part] == rows
    assert all(len(p) == 1 or len(p) * max(len(r.ids) for r in p) <= 12 for p in parts)
    assert [len(p) for p in parts] == [2, 1, 1, 2]


@pytest.fixture(scope="module")
def teacher():
    cfg = load_config(None, ["++distillation={}", "teacher.model_name=tiny", f"distillation.topk_logits_k={K}",
                             "teacher.tiny={hidden_size: 96, num_hidden_layers: 3}"])
    model = load_teacher(cfg)
    return Teacher(model, k=K, max_len=cfg.policy.max_total_sequence_length, max_batch_tokens=40)


def test_the_teachers_padded_batches_give_each_sequence_its_own_unpadded_topk(teacher):
    """Rows of different prompts and lengths, several forwards (max_batch_tokens 40), logits kept from the
    earliest completion position: each row's top-k is the one a lone forward of that sequence gives."""
    rng = random.Random(3)
    vocab = teacher.vocab_size
    cases = [([rng.randrange(vocab) for _ in range(p)], [rng.randrange(vocab) for _ in range(n)])
             for p, n in ((5, 4), (2, 7), (9, 1), (3, 0), (12, 6))]
    got = teacher.score([Row(ids=p + c, n=len(c)) for p, c in cases])
    for (prompt, completion), (values, ids) in zip(cases, got, strict=True):
        want_v, want_i = reference(teacher.model, prompt, completion, K)
        assert ids.tolist() == want_i
        torch.testing.assert_close(values, torch.tensor(want_v).reshape(-1, K), rtol=0, atol=1e-5)


def test_the_tiny_teacher_has_its_own_shape_and_seed():
    small = load_teacher(load_config(None, ["++distillation={}", "teacher.model_name=tiny"]))
    big = load_teacher(load_config(None, ["++distillation={}", "teacher.model_name=tiny",
                                          "teacher.tiny={hidden_size: 96}"]))
    other = load_teacher(load_config(None, ["++distillation={}", "teacher.model_name=tiny", "teacher.seed=5"]))
    assert big.config.hidden_size == 96 and small.config.hidden_size == 64
    assert not torch.equal(small.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize("prompt, completions, message", [
    ([1, 2], [], "completions must not be empty"),
    ([1, 2], [[3]] * 65, "at most 64"),
    ([], [[3]], "prompt_token_ids must not be empty"),
    ([1, 2], [[3], [4, 99]], "completions[1]: token id 99 is outside the teacher's vocabulary [0, 50)"),
    ([1, -1], [[3]], "prompt_token_ids: token id -1 is outside"),
    ([1] * 8, [[2] * 3], "completions[0]: prompt (8) + completion (3) tokens exceed 10"),
])
def test_a_request_the_teacher_cannot_score_is_refused_with_the_field_named(prompt, completions, message):
    with pytest.raises(InvalidArgument) as err:
        check_request(prompt, completions, vocab_size=50, max_len=10)
    assert message in str(err.value)


def test_a_request_within_every_bound_passes():
    check_request([1] * 7, [[49] * 3, []], vocab_size=50, max_len=10)


def test_a_teacher_that_cannot_take_the_students_sequences_or_k_is_refused_at_load(tmp_path):
    cfg = load_config(None, ["++distillation={}", "teacher.model_name=tiny", "policy.max_total_sequence_length=300"])
    short = load_teacher(cfg)
    short.config.max_position_embeddings = 299
    short.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="takes 299 positions, fewer than the 300"):
        load_teacher(load_config(None, ["policy.model_name=tiny", "++distillation={}", f"teacher.model_name={tmp_path}",
                                        "policy.max_total_sequence_length=300"]))
    with pytest.raises(ValueError, match="topk_logits_k 4096 is more than the teacher's"):
        load_teacher(load_config(None, ["++distillation={}", "teacher.model_name=tiny",
                                        "distillation.topk_logits_k=4096",
                                        "distillation.num_generations_per_prompt=1"]))

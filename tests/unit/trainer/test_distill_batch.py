"""build_batch for distillation: each completion's teacher top-k lands at the target it predicts, checked against a
position-by-position reference built from the groups, and against the targets themselves (a teacher whose top-1
is the sampled token). A completion without the teacher's scores is refused."""

import pytest
import torch
from distill_harness import K, groups

from services.trainer.batch import MissingTeacherScores, build_batch

VOCAB = 40


def reference(gs) -> list[dict[int, tuple[list[float], list[int]]]]:
    """Per row, target column -> the teacher's (logits, ids), walking each sequence one token at a time: the teacher's
    row t predicts completion token t, the token at sequence position len(prompt) + t, whose prediction is made at
    position len(prompt) + t - 1; target column c of a row is the prediction made at sequence position c."""
    out = []
    for g in gs:
        for c in g.completions:
            columns = {}
            for t in range(len(c.token_ids)):
                predicted_at = len(g.prompt_token_ids) + t - 1
                columns[predicted_at] = (list(c.teacher.logits[t * K:(t + 1) * K]),
                                         list(c.teacher.token_ids[t * K:(t + 1) * K]))
            out.append(columns)
    return out


def test_teacher_topk_is_aligned_with_the_target_it_predicts_and_zero_elsewhere():
    gs = groups(VOCAB)
    b = build_batch(gs, pad_id=0, teacher_k=K)
    width = b.targets.shape[1]
    assert b.teacher_topk_logits.shape == b.teacher_topk_indices.shape == (len(b), width, K)
    for i, columns in enumerate(reference(gs)):
        for col in range(width):
            logits, ids = columns.get(col, ([0.0] * K, [0] * K))
            assert b.teacher_topk_logits[i, col].tolist() == pytest.approx(logits), (i, col)
            assert b.teacher_topk_indices[i, col].tolist() == ids, (i, col)


def test_a_teacher_whose_top1_is_the_sampled_token_predicts_every_generated_target():
    gs = groups(VOCAB)
    for g in gs:
        for c in g.completions:
            for t, token in enumerate(c.token_ids):
                c.teacher.token_ids[t * K] = token
    b = build_batch(gs, pad_id=0, teacher_k=K)
    generated = b.token_mask.bool()
    assert generated.sum() > 20 and (~generated[0]).any()
    assert torch.equal(b.teacher_topk_indices[..., 0][generated], b.targets[generated])


def test_observation_tokens_of_a_multi_turn_episode_have_teacher_rows_but_no_loss():
    gs = groups(VOCAB)
    b = build_batch(gs, pad_id=0, teacher_k=K)
    start = len(gs[0].prompt_token_ids) - 1  # row 1: the two-turn episode, observation at completion tokens 1, 2
    assert b.token_mask[1, start + 1:start + 3].tolist() == [0.0, 0.0]
    assert b.teacher_topk_indices[1, start + 1].tolist() == list(gs[0].completions[1].teacher.token_ids[K:2 * K])


def test_sub_batches_keep_their_rows_teacher_topk():
    b = build_batch(groups(VOCAB), pad_id=0, teacher_k=K)
    part = b.rows(torch.tensor([4, 1]))
    assert torch.equal(part.teacher_topk_logits, b.teacher_topk_logits[[4, 1]])
    assert build_batch(groups(VOCAB), pad_id=0).rows(slice(0, 2)).teacher_topk_logits is None


@pytest.mark.parametrize("damage", ["missing", "short", "other_k"])
def test_a_completion_without_its_teachers_scores_is_refused(damage):
    gs = groups(VOCAB)
    c = gs[2].completions[0]
    if damage == "missing":
        c.ClearField("teacher")
    elif damage == "short":
        del c.teacher.logits[-K:]
        del c.teacher.token_ids[-K:]
    with pytest.raises(MissingTeacherScores, match="group 'g0'" if damage == "other_k" else "group 'g2'"):
        build_batch(gs, pad_id=0, teacher_k=K + 1 if damage == "other_k" else K)

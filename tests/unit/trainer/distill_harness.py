"""Distillation test data: real TrajectoryGroup messages whose completions carry a fixed teacher's top-k."""

from __future__ import annotations

import torch

from services.common.pb.flywheel.v1 import types_pb2

K = 4


def teacher_row(g: torch.Generator, vocab: int, k: int) -> tuple[list[float], list[int]]:
    """One position's top-k of a random teacher distribution: its k largest logits, largest first."""
    top = (3 * torch.randn(vocab, generator=g)).topk(k)
    return top.values.tolist(), top.indices.tolist()


def completion(g: torch.Generator, vocab: int, k: int, observation_at: int | None = None) -> types_pb2.Completion:
    """1-7 tokens, each with the teacher's top-k; with observation_at, an environment's 2 tokens (not generated) are
    spliced in there, as a multi-turn episode records them (they still have teacher rows, with no loss)."""
    n = int(torch.randint(1, 8, (1,), generator=g))
    ids = torch.randint(4, vocab, (n,), generator=g).tolist()
    mask = [True] * n
    if observation_at is not None:
        ids[observation_at:observation_at] = [5, 6]
        mask[observation_at:observation_at] = [False, False]
    c = types_pb2.Completion(token_ids=ids, generated_mask=mask, generation_logprobs=[-1.0] * len(ids),
                             reward=float(n % 2))  # varied within a group: GRPO advantages that are not all 0
    c.teacher.k = k
    for _ in ids:
        values, indices = teacher_row(g, vocab, k)
        c.teacher.logits.extend(values)
        c.teacher.token_ids.extend(indices)
    return c


def groups(vocab: int, n_groups: int = 3, size: int = 3, k: int = K, seed: int = 0) -> list[types_pb2.TrajectoryGroup]:
    """Prompts of 2-6 tokens; the second completion of the first group is a two-turn episode."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_groups):
        prompt = torch.randint(4, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        comps = [completion(g, vocab, k, observation_at=1 if (i, j) == (0, 1) else None) for j in range(size)]
        out.append(types_pb2.TrajectoryGroup(group_id=f"g{i}", prompt_id=f"p{i}", env_name="toy",
                                             prompt_token_ids=prompt, completions=comps))
    return out

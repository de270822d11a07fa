"""`flywheel up`'s stack with a `teacher:` section: the launcher starts the teacher servers (two replicas here)
before rollout, and every group that reaches replay carries its teacher's top-k (read back from replay), and the
trainer takes its distillation steps on them."""

from __future__ import annotations

import asyncio

from recorded import recorded_batches
from services.common.config import load_config
from services.local import LocalStack

STEPS = 2
K = 3


def test_flywheel_up_starts_the_teacher_replicas_and_every_group_in_replay_has_its_scores(tmp_path):
    cfg = load_config(None, ["++distillation={}", f"distillation.max_num_steps={STEPS}", "checkpointing.enabled=false",
                             "distillation.num_prompts_per_step=2", "distillation.num_generations_per_prompt=2",
                             "teacher.model_name=tiny", f"distillation.topk_logits_k={K}", "teacher.num_replicas=2"])
    with LocalStack(cfg, tmp_path) as stack:
        stack.start_services()
        stack.wait_for(lambda rows: len(rows) >= STEPS, f"{STEPS} steps", timeout_s=300)
        got = asyncio.run(recorded_batches(stack, STEPS))
        assert len(stack.cfg.teacher.addresses) == 2
        assert {"teacher-0", "teacher-1"} <= set(stack.children.metrics_ports)

    for batch in got:
        assert batch.groups
        for group in batch.groups:
            for c in group.completions:
                assert c.teacher.k == K and len(c.teacher.token_ids) == K * len(c.token_ids) > 0

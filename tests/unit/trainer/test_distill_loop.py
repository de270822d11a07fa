"""The trainer loop's step in a distillation run: the batch it hands the ranks carries the teacher's top-k and no
GRPO advantages (unless distillation.env_reward_weight asks for them), and a step whose batch holds a completion
without teacher scores stops before any rank trains. Real config, batch building and metrics; the replay stub
answers with fixed groups and the ranks record what they are asked to run (no model)."""

import asyncio
from types import SimpleNamespace

import pytest
from distill_harness import K, groups

from services.common.config import load_config
from services.common.pb.flywheel.v1 import replay_pb2
from services.trainer.batch import MissingTeacherScores
from services.trainer.main import Trainer

RUN = ["++distillation.max_num_steps=2", "++distillation.num_prompts_per_step=3",
       "++distillation.num_generations_per_prompt=3", "++teacher.model_name=tiny",
       f"++distillation.topk_logits_k={K}"]


class Replay:
    def __init__(self, gs) -> None:
        self.groups = gs

    async def Sample(self, request, **_):  # noqa: N802 (the rpc's name)
        return replay_pb2.SampleResponse(ready=True, groups=self.groups)


def step(overrides: list[str], gs) -> list[tuple]:
    """Step 0 of a run with these overrides on replay's answer `gs`; what the ranks were asked to run."""
    calls = []

    def call(name, *args):
        calls.append((name, *args))
        return {"loss": 0.5, "grad_norm": 1.0, "lr": 0.1, "num_valid_samples": 9.0}

    async def run():  # the trainer's replay channel needs a running loop
        backend = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0))
        ranks = SimpleNamespace(target=SimpleNamespace(backend=backend), call=call)
        trainer = Trainer(load_config(None, RUN + overrides), ranks, bus=None, sender=None)
        trainer.replay = Replay(gs)

        async def no_sync(version, members=None):  # no rollout worker to push weights to
            return 0.0
        trainer._sync = no_sync
        return await trainer._step(0, asyncio.Event())

    metrics, _ = asyncio.run(run())
    assert metrics["train/loss"] == 0.5 and "train/reward" in metrics
    return calls


def test_a_distillation_step_trains_on_the_teachers_topk_without_advantages():
    [(name, batch, advantages)] = step([], groups(40))
    assert name == "train_distill" and advantages is None
    assert batch.teacher_topk_indices.shape[-1] == K and batch.teacher_topk_logits.abs().sum() > 0


def test_an_environment_reward_weight_hands_the_ranks_grpo_advantages_too():
    [(name, batch, advantages)] = step(["++distillation.env_reward_weight=0.5"], groups(40))
    assert name == "train_distill" and advantages.shape == (len(batch),) and advantages.abs().sum() > 0


def test_a_group_without_teacher_scores_stops_the_step_before_any_rank_trains():
    gs = groups(40)
    gs[1].completions[2].ClearField("teacher")
    with pytest.raises(MissingTeacherScores, match="group 'g1'"):
        step([], gs)

"""A distillation run's teacher servers in the device plan (services/common/devices.py): one device each after the
trainer's and the rollout workers', none when teacher.addresses names servers started elsewhere. Placements
written out by hand."""

from __future__ import annotations

from services.common.config import load_config
from services.common.devices import checked_plan

RUN = ["policy.generation.backend=vllm", "trainer.device=cuda", "weight_sync.backend=nccl", "++distillation={}",
       "teacher.model_name=tiny"]


def placed(*overrides: str, gpus: int) -> dict[str, str]:
    p = checked_plan(load_config(None, [*RUN, *overrides]), [str(i) for i in range(gpus)])
    return {name: p.visible(name) for name in p.devices}


def test_each_teacher_replica_gets_a_device_after_the_trainer_and_rollout():
    got = placed("trainer.nproc_per_node=2", "teacher.num_replicas=2", gpus=5)
    assert got == {"trainer": "0,1", "rollout-0": "2", "teacher-0": "3", "teacher-1": "4"}


def test_teachers_started_elsewhere_take_no_device_here():
    got = placed("teacher.num_replicas=2", "teacher.addresses=[node7:50057]", gpus=3)
    assert got == {"trainer": "0", "rollout-0": "1"}

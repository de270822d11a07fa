"""The `teacher:` section (services/common/config_teacher.py): the tiny teacher's shape, and groups whose teacher
scores could not fit one NATS message refused before anything starts."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.common.config_teacher import NATS_MAX_PAYLOAD, group_payload_bytes


def test_a_run_without_a_distillation_section_has_no_teacher():
    assert not load_config(None, []).uses_teacher


def test_the_tiny_teacher_is_the_policys_shape_with_its_own_changes_and_one_address_by_default():
    cfg = load_config(None, ["++distillation={}", "teacher.model_name=tiny",
                             "teacher.tiny={hidden_size: 128, num_hidden_layers: 4}"])
    assert (cfg.teacher_tiny.hidden_size, cfg.teacher_tiny.num_hidden_layers) == (128, 4)
    assert cfg.teacher_tiny.intermediate_size == cfg.policy.tiny.intermediate_size
    assert cfg.teacher_addresses == [cfg.addresses.teacher]
    replicas = load_config(None, ["++distillation={}", "teacher.model_name=tiny", "teacher.addresses=[a:1, b:2]"])
    assert replicas.teacher_addresses == ["a:1", "b:2"]


@pytest.mark.parametrize("overrides, message", [
    (["++distillation={}", "teacher.model_name=tiny", "teacher.tiny={hidden_size: 0}"], "teacher.tiny: hidden_size"),
    (["++distillation={}", "teacher.model_name=tiny", "teacher.tiny={depth: 3}"], "teacher.tiny: depth"),
    (["++distillation={}", "teacher.model_name=org/model", "teacher.tiny={hidden_size: 8}"],
     "shapes the tiny teacher only"),
    (["++distillation={}", "teacher.model_name=tiny", "policy.model_name=org/student"], "the student must be tiny too"),
    (["++distillation={}", "teacher.model_name=tiny", "distillation.topk_logits_k=0"], "distillation.topk_logits_k"),
])
def test_a_teacher_that_cannot_work_is_refused_with_its_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_a_group_whose_teacher_scores_would_pass_nats_max_payload_is_refused_at_config_time():
    """NeMo RL's distillation_math.yaml sizes (k 64, 8192 tokens, 1 generation) fit; 2 generations do not."""
    fits = ["++distillation={}", "teacher.model_name=tiny", "distillation.topk_logits_k=64",
            "policy.max_total_sequence_length=8192",
            "distillation.num_generations_per_prompt=1"]
    assert load_config(None, fits).teacher.topk_logits_k == 64
    assert group_payload_bytes(64, 1, 8192) <= NATS_MAX_PAYLOAD < group_payload_bytes(64, 2, 8192)
    with pytest.raises(ConfigError, match="over NATS' max_payload"):
        load_config(None, [*fits[:-1], "distillation.num_generations_per_prompt=2"])


def test_the_bound_holds_for_a_real_group_at_its_longest():
    """protobuf's own encoding of a group with every field at its widest stays within group_payload_bytes."""
    from services.common.pb.flywheel.v1 import types_pb2

    k, n, g = 16, 4000, 3  # large enough that GROUP_HEADROOM cannot hide a per-entry undercount
    big_id, logprob = 2**27 - 1, -1.2345
    completion = types_pb2.Completion(
        token_ids=[big_id] * n, generated_mask=[True] * n, generation_logprobs=[logprob] * n, version_start=10**6,
        version_end=10**6, teacher=types_pb2.TeacherTopK(k=k, logits=[-3.5e38] * (n * k), token_ids=[big_id] * (n * k)))
    group = types_pb2.TrajectoryGroup(group_id="g" * 64, prompt_id="p" * 64, env_name="math",
                                      prompt_token_ids=[big_id] * 512, completions=[completion] * g)
    assert group.ByteSize() <= group_payload_bytes(k, g, n)

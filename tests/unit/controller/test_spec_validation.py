"""`registry.validate` names the bad field of an EnvironmentSpec (pure, no network)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import controller_pb2, types_pb2
from services.controller.registry import validate


def spec(**kw) -> controller_pb2.EnvironmentSpec:
    base = {"name": "calc", "address": "127.0.0.1:7000", "weight": 1.0}
    return controller_pb2.EnvironmentSpec(**{**base, **kw})


def test_a_good_spec_passes():
    validate(spec(rows=[types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(role="user", content="hi")])],
                  max_turns=3, reward_scale=2.0, timeout_seconds=5,
                  sampling=types_pb2.SamplingParams(max_new_tokens=8, stop_strings=["\n"])))
    validate(spec(address="", kind="math", weight=0.0))
    validate(spec(address="[::1]:7000"))


@pytest.mark.parametrize("fields, message", [
    ({"name": "Calc!"}, r"name must match"),
    ({"name": ""}, r"name must match"),
    ({"kind": "math"}, r"calc: set exactly one of kind .* or address"),
    ({"address": ""}, r"calc: set exactly one of kind"),
    ({"address": "localhost"}, r"calc: address must be host:port, got 'localhost'"),
    ({"address": "localhost:99999"}, r"address must be host:port"),
    ({"weight": -0.5}, r"calc: weight must be >= 0, got -0.5"),
    ({"weight": float("nan")}, r"calc: weight must be >= 0"),
    ({"jsonl_path": "a.jsonl", "rows": [types_pb2.DatasetRow(messages=[types_pb2.ChatMessage(content="x")])]},
     r"at most one of rows or jsonl_path"),
    ({"rows": [types_pb2.DatasetRow()]}, r"calc: rows\[0\] has no messages"),
    ({"max_turns": -1}, r"calc: max_turns must be in 0..1000"),
    ({"reward_scale": -1}, r"calc: reward_scale must be >= 0"),
    ({"timeout_seconds": -1}, r"calc: timeout_seconds must be >= 0"),
    ({"sampling": types_pb2.SamplingParams(max_new_tokens=-1)}, r"sampling.max_new_tokens must be >= 0"),
    ({"sampling": types_pb2.SamplingParams(top_p=1.5)}, r"sampling.top_p must be in \[0, 1\]"),
    # Rollout cannot sample below 1e-5: the logits over the temperature overflow (seen under fuzzing with a
    # denormal 1e-40: every group of that environment failed in generate and came back for ever).
    ({"sampling": types_pb2.SamplingParams(temperature=1e-40)}, r"calc: sampling.temperature must be 0 .* \[1e-05"),
    ({"sampling": types_pb2.SamplingParams(temperature=1e-7)}, r"calc: sampling.temperature must be 0 .* \[1e-05"),
    ({"reward_scale": float("nan")}, r"calc: reward_scale must be >= 0"),
    ({"sampling": types_pb2.SamplingParams(stop_strings=[""])}, r"stop_strings must not contain an empty"),
])
def test_a_bad_field_is_invalid_argument_naming_it(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        validate(spec(**fields))


def test_a_config_file_environment_carries_every_field_the_api_takes():
    from services.common.config import FlywheelConfig
    from services.controller.main import spec_from_config

    cfg = FlywheelConfig.model_validate({"environments": [{
        "name": "puzzle", "kind": "sliding_puzzle", "weight": 2.0, "max_turns": 6, "reward_scale": 0.5,
        "sampling": {"max_new_tokens": 16, "temperature": 0.7, "stop_strings": ["</move>"]}}]})
    out = spec_from_config(cfg.environments[0])
    validate(out)
    assert (out.name, out.kind, out.weight, out.max_turns, out.reward_scale) == ("puzzle", "sliding_puzzle", 2.0, 6, 0.5)
    assert (out.sampling.max_new_tokens, out.sampling.top_p, list(out.sampling.stop_strings)) == (16, 0.0, ["</move>"])
    assert out.sampling.temperature == pytest.approx(0.7)


def test_a_config_file_environment_rejects_a_zero_reward_scale():
    from pydantic import ValidationError

    from services.common.config import FlywheelConfig

    with pytest.raises(ValidationError, match="reward_scale"):
        FlywheelConfig.model_validate({"environments": [{"name": "t", "kind": "toy_copy", "reward_scale": 0}]})

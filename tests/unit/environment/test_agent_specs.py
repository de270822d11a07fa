"""Agent environment specs where they enter: the config file, the controller's validation, the agent registry
(pure, no network), and a program's result line."""

from __future__ import annotations

import sys

import pytest

from services.common.config import load_config
from services.common.errors import InvalidArgument
from services.common.pb.flywheel.v1 import controller_pb2
from services.common.structs import to_struct
from services.controller.main import spec_from_config
from services.controller.registry import validate
from services.environment.agents import AgentError
from services.environment.agents.program import ProgramAgent, parse_result
from services.environment.agents.registry import UnknownAgent, make_agent

AGENT = "{type: program, command: [python, a.py]}"


def test_an_agent_in_the_mix_turns_the_endpoint_on_and_reaches_the_controller_as_its_spec():
    cfg = load_config(None, [f"environments=[{{name: a, kind: agent, dataset: rows.jsonl, agent: {AGENT}}}]"])
    assert cfg.policy.generation.endpoint.enabled
    proto = spec_from_config(cfg.environments[0])
    validate(proto)
    assert proto.kind == "agent" and dict(proto.agent)["type"] == "program"
    assert not load_config(None, ["environments=[{name: t, kind: toy_copy}]"]).policy.generation.endpoint.enabled


@pytest.mark.parametrize("entry, message", [
    ("{name: a, kind: agent, dataset: rows.jsonl}", "kind agent needs `agent`"),
    (f"{{name: a, kind: toy_copy, agent: {AGENT}}}", "kind agent needs `agent`"),
    (f"{{name: a, kind: agent, agent: {AGENT}}}", "generates no prompts: give it a dataset"),
])
def test_a_config_agent_entry_is_refused_without_its_parts(entry, message):
    with pytest.raises(Exception, match=message):
        load_config(None, [f"environments=[{entry}]"])


def test_a_verifiers_entry_needs_no_dataset_its_taskset_is_the_prompts():
    entry = "{name: v, kind: agent, agent: {type: verifiers, env: {taskset: {id: t}}}}"
    cfg = load_config(None, [f"environments=[{entry}]"])
    assert cfg.environments[0].dataset == "" and cfg.policy.generation.endpoint.enabled


def test_the_controller_refuses_an_agent_kind_without_a_spec_and_a_spec_without_the_kind():
    with pytest.raises(InvalidArgument, match="needs `agent`"):
        validate(controller_pb2.EnvironmentSpec(name="a", kind="agent", weight=1))
    with pytest.raises(InvalidArgument, match="needs `agent`"):
        validate(controller_pb2.EnvironmentSpec(name="a", kind="math", weight=1, agent=to_struct({"type": "x"})))


def test_the_registry_builds_a_program_agent_and_names_what_is_wrong():
    assert isinstance(make_agent({"type": "program", "command": ["python", "a.py"]}), ProgramAgent)
    with pytest.raises(UnknownAgent, match="agent.type must be one of"):
        make_agent({"command": ["x"]})
    with pytest.raises(UnknownAgent, match="unexpected keyword argument 'shell'"):
        make_agent({"type": "program", "command": ["x"], "shell": True})
    with pytest.raises(UnknownAgent, match="non-empty list of strings"):
        make_agent({"type": "program", "command": "python a.py"})


def test_the_last_line_is_the_result_and_anything_else_is_a_malformed_reward():
    result = parse_result('log\n{"reward": 1, "metrics": {"calls": 2}}\n\n')
    assert (result.reward, result.metrics) == (1.0, {"calls": 2.0})
    for bad in ('{"reward": true}', '{"reward": 1e999}', '[1]', '{"reward": 1, "metrics": [1]}', '{"reward": 1}\nok'):
        with pytest.raises(AgentError) as err:
            parse_result(bad)
        assert err.value.reason == "malformed_reward"


def test_the_registry_builds_a_verifiers_agent_from_its_spec_fields_and_refuses_unknown_ones():
    from services.environment.agents.verifiers_agent import VerifiersAgent

    env = {"taskset": {"id": "some_taskset"}}
    agent = make_agent({"type": "verifiers", "env": env, "python": sys.executable})
    assert isinstance(agent, VerifiersAgent) and agent.spec["env"] == env
    with pytest.raises(UnknownAgent, match="verifiers"):
        make_agent({"type": "verifiers", "env": env, "python": sys.executable, "bogus": 1})
    with pytest.raises(UnknownAgent, match="not found"):
        make_agent({"type": "verifiers", "env": env, "python": "/nonexistent/python"})
    with pytest.raises(UnknownAgent, match="per_episode or shared"):
        make_agent({"type": "verifiers", "env": env, "python": sys.executable, "runner": "pooled"})
    assert make_agent({"type": "verifiers", "env": env, "python": sys.executable, "runner": "shared"})._shared

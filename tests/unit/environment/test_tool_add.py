"""The tool_add environment: it runs the model's add calls, and rewards only the tool's right result after a call."""

from __future__ import annotations

from services.common.messages import message_from_dict, message_to_dict
from services.common.pb.flywheel.v1 import environment_pb2
from services.environment.base import make_environment
from services.environment.envs.tool_add import ADD_TOOL
from services.environment.server import decode_episodes, encode_result

PROMPT = [{"role": "user", "content": "add 3 4"}]
META = {"ground_truth": "7"}


def _call(name="add", arguments='{"a": 3, "b": 4}', id_="call_1"):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def _step(conversation, meta=META):
    return make_environment("tool_add").step([conversation], [meta], return_extracted_answer=True)[0]


def test_a_call_is_answered_by_a_tool_message_with_the_sum():
    r = _step(PROMPT + [{"role": "assistant", "content": "", "tool_calls": [_call()]}])
    assert not r.terminated and r.reward == 0.0
    assert r.messages == [{"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "7"}]
    assert r.metadata == {"ground_truth": "7", "tool_result": "7"}


def test_each_call_gets_its_own_result_in_order():
    r = _step(PROMPT + [{"role": "assistant", "content": "", "tool_calls": [
        _call(arguments='{"a": 1, "b": 1}', id_="x"), _call(id_="y")]}])
    assert [(m["tool_call_id"], m["content"]) for m in r.messages] == [("x", "2"), ("y", "7")]


def test_the_right_answer_after_the_right_call_scores_one():
    called = _step(PROMPT + [{"role": "assistant", "content": "", "tool_calls": [_call()]}])
    conversation = PROMPT + [{"role": "assistant", "content": "", "tool_calls": [_call()]}, *called.messages,
                             {"role": "assistant", "content": " 7 "}]
    r = _step(conversation, called.metadata)
    assert r.terminated and r.reward == 1.0 and r.answer == "7"


def test_the_right_answer_without_a_call_scores_zero():
    r = _step(PROMPT + [{"role": "assistant", "content": "7"}])
    assert r.terminated and r.reward == 0.0


def test_a_wrong_answer_after_the_call_scores_zero():
    r = _step(PROMPT + [{"role": "assistant", "content": "8"}], {"ground_truth": "7", "tool_result": "7"})
    assert r.terminated and r.reward == 0.0


def test_a_call_of_the_wrong_numbers_earns_nothing_from_its_result():
    called = _step(PROMPT + [{"role": "assistant", "content": "", "tool_calls": [_call(arguments='{"a": 1, "b": 1}')]}])
    assert called.messages[0]["content"] == "2" and "tool_result" not in called.metadata
    assert _step(PROMPT + [{"role": "assistant", "content": "2"}], called.metadata).reward == 0.0


def test_bad_calls_are_answered_with_an_error_not_a_crash():
    r = _step(PROMPT + [{"role": "assistant", "content": "", "tool_calls": [
        _call(arguments="{not json"), _call(arguments='{"a": "3", "b": 4}'), _call(name="mul")]}])
    assert not r.error and [m["content"].split(":")[0] for m in r.messages] == ["error"] * 3


def test_prompts_offer_the_add_tool_and_are_reproducible():
    env = make_environment("tool_add")
    rows = env.prompts(20, seed=1, offset=0)
    assert rows == env.prompts(20, seed=1, offset=0) and rows[5:] == env.prompts(15, seed=1, offset=5)
    for row in rows:
        _, a, b = row["messages"][0]["content"].split()
        assert row["tools"] == [ADD_TOOL] and row["metadata"]["ground_truth"] == str(int(a) + int(b))


def test_the_service_hands_over_tool_calls_and_sends_the_tool_messages_back():
    conversation = PROMPT + [{"role": "assistant", "content": "", "tool_calls": [_call()]}]
    request = environment_pb2.StepRequest(env_name="tool_add", episodes=[environment_pb2.Episode(
        messages=[message_from_dict(m) for m in conversation])])
    conversations, metadata = decode_episodes(request)
    assert conversations == [conversation]
    result = encode_result(_step(conversations[0]))
    assert [message_to_dict(m) for m in result.observations] == [
        {"role": "tool", "content": "7", "tool_call_id": "call_1", "name": "add"}]

"""An agent episode as Generate answers it (agent_groups.episode_completion): pure, on hand-made recordings."""

from __future__ import annotations

from services.common.messages import message_to_dict
from services.common.pb.flywheel.v1 import environment_pb2
from services.rollout.agent_groups import episode_completion
from services.rollout.endpoint.trajectory import Choice, Sample, Trajectory

PROMPT = [{"role": "user", "content": "copy 3"}]
CALL = {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": {"task": "copy 3"}}}


def _sample(prompt: list[int], answers: list[list[int]]) -> Sample:
    s = Sample()
    s.extend(prompt, None)
    for tokens in answers:
        s.extend([], _choice(tokens))
    return s


def _choice(tokens: list[int]) -> Choice:
    return Choice(token_ids=tokens, logprobs=[-0.5] * len(tokens), versions=[2] * len(tokens))


def _result(**kw) -> environment_pb2.RunAgentResponse:
    return environment_pb2.RunAgentResponse(reward=kw.get("reward", 1.5), named_rewards=kw.get("named", {}),
                                            metrics=kw.get("metrics", {}))


def test_the_completion_is_the_longest_sample_after_its_prompt_with_the_agents_scaled_reward_and_metrics():
    short, long = _sample([1, 2], [[3]]), _sample([1, 2, 9], [[4, 5], [6]])
    traj = Trajectory(samples=[short, long], calls=3)
    c = episode_completion(traj, _result(named={"format": 0.5}, metrics={"chars": 7.0}), scale=2.0, version=5,
                           decode=lambda ids: "/".join(map(str, ids)))
    assert list(c.token_ids) == [4, 5, 6] and list(c.generated_mask) == [True] * 3
    assert c.version_start == c.version_end == 2 and c.turns == 3
    assert c.reward == 3.0 and dict(c.named_rewards) == {"format": 1.0} and dict(c.metrics) == {"chars": 7.0}
    assert c.text == "4/5/6"


def test_the_messages_are_the_recorded_conversation_from_its_first_assistant_turn_on():
    conversation = [*PROMPT, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "c0", "content": "3"}, {"role": "assistant", "content": "3"}]
    traj = Trajectory(samples=[_sample([1], [[7]])], calls=1, conversation=conversation)
    c = episode_completion(traj, _result(), scale=1.0, version=0, decode=lambda ids: "x")
    messages = [message_to_dict(m) for m in c.messages]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"task": "copy 3"}'}
    assert messages[1] == {"role": "tool", "content": "3", "tool_call_id": "c0"}


def test_completions_calls_leave_their_text_as_one_assistant_turn_and_no_call_leaves_nothing():
    called = episode_completion(Trajectory(samples=[_sample([1], [[7, 8]])], calls=1), _result(), scale=1.0,
                                version=0, decode=lambda ids: "seven eight")
    assert [message_to_dict(m) for m in called.messages] == [{"role": "assistant", "content": "seven eight"}]
    silent = episode_completion(Trajectory(), _result(reward=0.25), scale=1.0, version=4, decode=lambda ids: "")
    assert not silent.messages and not silent.token_ids and silent.reward == 0.25
    assert silent.version_start == silent.version_end == 4

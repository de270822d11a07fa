"""The reward-model server's scoring (services/rollout/reward_model.py), on the tiny random reward model: a batch
scores each conversation as it scores alone, and a long one keeps its end."""

from __future__ import annotations

import pytest
import torch

from services.common.config_data import RewardModelEnvConfig, TokenizerConfig
from services.common.errors import InvalidArgument
from services.rollout.reward_model import RewardModel


def _chat(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


CHATS = [_chat("1+1", "2"), _chat("copy abc", "abc abc abc"), _chat("say hi", "hello there, how are you?")]


def test_a_batch_scores_each_conversation_as_it_scores_alone():
    """Right padding: the score is read at each row's last real token, so padding changes nothing."""
    rm = RewardModel(RewardModelEnvConfig(model_name="tiny", precision="float32", batch_size=2))
    alone = [rm.score([c])[0] for c in CHATS]
    together = rm.score(CHATS)  # two batches: the first with rows of different lengths
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), rtol=0, atol=1e-5)
    assert len({round(s, 4) for s in alone}) == 3  # a random model still tells them apart


def test_the_score_reads_the_model_at_the_conversations_last_token():
    rm = RewardModel(RewardModelEnvConfig(model_name="tiny", precision="float32"))
    ids = rm.token_ids(CHATS[1])
    with torch.no_grad():
        expected = rm.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert abs(rm.score([CHATS[1]])[0] - expected) < 1e-5


def test_a_conversation_longer_than_max_model_len_keeps_its_end():
    rm = RewardModel(RewardModelEnvConfig(model_name="tiny", precision="float32", max_model_len=12))
    full = RewardModel(RewardModelEnvConfig(model_name="tiny", precision="float32")).token_ids(CHATS[2])
    assert len(full) > 12 and rm.token_ids(CHATS[2]) == full[-12:]


def test_an_observation_is_scored_as_the_users_turn():
    """The environment's role is Flywheel's; a reward model's chat template knows user and assistant."""
    rm = RewardModel(RewardModelEnvConfig(model_name="tiny", precision="float32"))
    observed = [*CHATS[0], {"role": "environment", "content": "wrong"}, {"role": "assistant", "content": "3"}]
    as_user = [*CHATS[0], {"role": "user", "content": "wrong"}, {"role": "assistant", "content": "3"}]
    assert rm.token_ids(observed) == rm.token_ids(as_user)


def test_a_conversation_with_no_tokens_is_the_callers_mistake():
    """Without a chat template (null: the messages' text joined), empty messages leave nothing to score."""
    rm = RewardModel(RewardModelEnvConfig(model_name="tiny", precision="float32",
                                          tokenizer=TokenizerConfig(chat_template=None)))
    with pytest.raises(InvalidArgument, match=r"episodes\[1\]: no tokens to score"):
        rm.score([CHATS[0], _chat("", "")])

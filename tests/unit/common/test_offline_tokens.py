"""Offline examples as the groups the trajectory stream carries: assistant turns are the trained tokens, tools reach
the chat template, pairs are (chosen, rejected) after one context, and the plan serves each example once an epoch.
The expected tokens are the tokenizer's own rendering of the whole conversation, not this module's pieces."""

import subprocess
import sys

import pytest

from services.common.config import PolicyConfig
from services.common.tokenizing import load_tokenizer_without_torch
from services.common.data.offline import PreferenceExample, SFTExample
from services.common.data.offline_tokens import build_plan, group_of, tokenize_pair, tokenize_sft

TOOLS_TEMPLATE = ("{{ bos_token }}{% if tools %}t:{{ tools | length }}\n{% endif %}"
                  "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}")


@pytest.fixture
def tok():
    return load_tokenizer_without_torch(PolicyConfig(model_name="tiny"))


def _text(tok, ids, mask=None):
    return "".join(tok.convert_ids_to_tokens([i for j, i in enumerate(ids) if mask is None or mask[j]]))


def test_an_sft_group_trains_every_assistant_turn_and_nothing_else(tok):
    messages = [{"role": "user", "content": "copy 3"}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "33"}]
    group = group_of(tokenize_sft(tok, SFTExample(messages=messages)), group_id="g", step=4, env_name="sft", now_ns=0)
    whole = tok.apply_chat_template(messages, tokenize=False)
    c = group.completions[0]
    ids = list(group.prompt_token_ids) + list(c.token_ids)
    assert _text(tok, ids) == whole + "<eos>"  # the template's text, then add_eos
    mask = [False] * len(group.prompt_token_ids) + list(c.generated_mask)
    assert _text(tok, ids, mask) == "a:3\na:33\n<eos>"
    assert (group.version_start, group.target_step, c.version_start) == (4, 4, 4)  # replay serves it to step 4


def test_tools_reach_the_chat_template(tok):
    tok.chat_template = TOOLS_TEMPLATE
    ex = SFTExample(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                    tools=[{"type": "function", "function": {"name": "f"}}])
    t = tokenize_sft(tok, ex)
    assert _text(tok, [i for ids, _ in t.context for i in ids]) == "<bos>t:1\nu:hi\n"


def test_a_pair_is_two_completions_after_one_context_chosen_first(tok):
    ex = PreferenceExample(context=[{"role": "user", "content": "copy 2"}], chosen=[{"role": "assistant", "content": "2"}],
                           rejected=[{"role": "assistant", "content": "4"}])
    group = group_of(tokenize_pair(tok, ex), group_id="g", step=0, env_name="dpo", now_ns=0)
    assert _text(tok, group.prompt_token_ids) == "<bos>u:copy 2\n"
    assert [_text(tok, c.token_ids) for c in group.completions] == ["a:2\n<eos>", "a:4\n<eos>"]
    assert [c.reward for c in group.completions] == [1.0, 0.0]


def test_the_plan_serves_each_example_once_an_epoch_and_drops_rows_over_the_limit(tok):
    examples = [SFTExample(messages=[{"role": "user", "content": f"copy {i % 5}"},
                                     {"role": "assistant", "content": str(i % 5) * (30 if i == 7 else 1)}],
                           where=f"f.jsonl:{i + 1}") for i in range(10)]
    plan = build_plan(tok, examples, kind="sft", max_seq_length=24, per_step=4, max_num_steps=100, epochs=2, seed=1,
                      shuffle=True)
    assert [d.where for d in plan.drops] == ["f.jsonl:8"] and "sequence limit" in plan.drops[0].reason
    assert plan.steps == 4  # 9 kept examples, 2 full steps an epoch, 2 epochs
    for epoch in range(2):
        seen = [t.where for step in (2 * epoch, 2 * epoch + 1) for t in plan.rows(step)]
        assert len(set(seen)) == 8
    assert [t.where for t in plan.rows(0)] != [t.where for t in plan.rows(2)]  # reshuffled
    again = build_plan(tok, examples, kind="sft", max_seq_length=24, per_step=4, max_num_steps=100, epochs=2, seed=1,
                       shuffle=True)
    assert [t.where for t in again.rows(3)] == [t.where for t in plan.rows(3)]  # controller and trainer agree


def test_the_offline_controller_imports_no_torch():
    code = ("import sys; import services.controller.main, services.controller.offline; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

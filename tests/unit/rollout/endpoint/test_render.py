"""Prompt splicing with the tiny tokenizer: the recorded ids stay, the template's rendering after the turn's
end-of-turn stop token follows; templates that do not allow it give None (the call is rendered plainly)."""

from __future__ import annotations

import pytest

from services.common.modeling import build_tiny_tokenizer
from services.rollout.endpoint.render import render_ids, spliced

EOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture
def tok():
    t = build_tiny_tokenizer()
    t.chat_template = EOS_TEMPLATE
    return t


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "ok"}]


def test_a_turn_that_sampled_eos_keeps_the_recorded_ids_then_the_templates_rest(tok):
    # The engine sampled "y", <unk>, "o", <eos>: the text "yo" re-tokenizes without the <unk>.
    recorded = ids(tok, "<bos>u:hi\na:") + [tok.convert_tokens_to_ids("y"), tok.unk_token_id,
                                            tok.convert_tokens_to_ids("o"), tok.eos_token_id]
    plain = render_ids(tok, CONVERSATION, None, {}, generation=True)
    assert plain[:len(recorded)] != recorded  # a plain rendering would not extend the record
    assert spliced(tok, CONVERSATION, None, {}, recorded, {tok.eos_token_id}) == recorded + ids(tok, "\nu:ok\na:")


def test_a_truncated_turn_gets_the_templates_end_of_turn_token(tok):
    recorded = ids(tok, "<bos>u:hi\na:yo")  # stopped by max_tokens: no EOS sampled
    want = recorded + ids(tok, "<eos>\nu:ok\na:")
    assert spliced(tok, CONVERSATION, None, {}, recorded, {tok.eos_token_id}) == want


def test_a_template_whose_turns_end_without_a_stop_token_cannot_be_spliced(tok):
    tok.chat_template = build_tiny_tokenizer().chat_template  # "a:yo\n": no EOS after the turn
    assert spliced(tok, CONVERSATION, None, {}, ids(tok, "<bos>u:hi\na:yo<eos>"), {tok.eos_token_id}) is None


def test_a_template_that_rewrites_the_history_as_messages_follow_cannot_be_spliced(tok):
    # Opens with the number of messages: the rendering up to the turn is no prefix of the whole.
    tok.chat_template = "{{ messages | length }}" + EOS_TEMPLATE
    recorded = ids(tok, "1<bos>u:hi\na:yo<eos>")
    assert spliced(tok, CONVERSATION, None, {}, recorded, {tok.eos_token_id}) is None


def test_short_requests_render_on_the_loop_and_long_ones_in_a_thread():
    import asyncio
    import threading

    from services.rollout.endpoint.render import INLINE_CHARS, off_loop_if_long

    async def where(size: int) -> bool:
        return await off_loop_if_long(size, lambda: threading.get_ident() == threading.main_thread().ident)

    assert asyncio.run(where(INLINE_CHARS)) is True
    assert asyncio.run(where(INLINE_CHARS + 1)) is False

"""policy.tokenizer.chat_template and chat_template_kwargs reach the tokenizer rollout formats prompts with."""

from services.common.config import load_config
from services.common.modeling import load_tokenizer

MESSAGES = [{"role": "system", "content": "be brief. "}, {"role": "user", "content": "what is 1+1?"}]


def _text(*overrides: str) -> str:
    tok = load_tokenizer(load_config(None, list(overrides)).policy)
    return tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)


def test_default_keeps_the_tokenizers_own_template():
    assert _text() == "<bos>s:be brief. \nu:what is 1+1?\na:"


def test_null_is_no_template_the_messages_text_joined_as_for_base_models():
    assert _text("policy.tokenizer.chat_template=null") == "be brief. what is 1+1?"


def test_a_custom_template_sees_chat_template_kwargs():
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[-1].content }}"
    assert _text(f"policy.tokenizer.chat_template='{template}'",
                 "policy.tokenizer.chat_template_kwargs={enable_thinking: true}") == "<think>what is 1+1?"
    assert _text(f"policy.tokenizer.chat_template='{template}'") == "what is 1+1?"

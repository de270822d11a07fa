"""The policy's tokenizer without torch: the controller tokenizes offline data with it (SFT, DPO, RM), and a
distillation run checks with it that the teacher shares the student's vocabulary before anything starts.

`transformers.AutoTokenizer` imports torch (its auto module does), the fast tokenizer class does
not, so a checkpoint's tokenizer is loaded as PreTrainedTokenizerFast from its tokenizer.json (every
current chat model ships one; a slow-only tokenizer is refused with that reason). The tiny model's
character-level tokenizer is built here too; services/common/modeling.py re-exports all of it.
"""

from __future__ import annotations

import functools
import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.common.chat_template import require_chat_template
from services.common.config import PolicyConfig

TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_CHARS = string.digits + string.ascii_lowercase + " :=+-*/()[]{}<>.,!?'\"\\_\n"
# role initial + ":" per message, then "a:" to prompt the assistant; no hidden tokens. Tools offered go first, one
# line "tools: add(a,b) ...". An assistant's tool calls follow its text in Hermes/Qwen form,
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, which vLLM's "hermes" parser reads; a tool's result is
# a message like any other ("t:7").
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}"
    "({{ (t['function']['parameters'] or {}).get('properties', {}) | join(',') }}){% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
"""Jinja's trim_blocks (on in transformers) drops a newline right after a tag: the newlines are expressions."""


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + list(TINY_CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""NeMo RL's passthrough_prompt_response: the messages' text joined, no special tokens (base models)."""


def load_tokenizer(cfg: PolicyConfig):
    if cfg.model_name == "tiny":
        return with_chat_template(build_tiny_tokenizer(), cfg.tokenizer, "tiny")
    from transformers import AutoTokenizer  # imports torch: trainer and rollout only

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return with_chat_template(tok, cfg.tokenizer, cfg.tokenizer_name)


def load_tokenizer_without_torch(cfg: PolicyConfig) -> PreTrainedTokenizerFast:
    """The same tokenizer as load_tokenizer gives, for processes that never import torch."""
    if cfg.model_name == "tiny":
        return with_chat_template(build_tiny_tokenizer(), cfg.tokenizer, "tiny")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(cfg.tokenizer_name)
    except (OSError, ValueError) as err:
        raise ValueError(f"policy.tokenizer: {cfg.tokenizer_name!r} has no fast tokenizer (tokenizer.json), which "
                         f"offline data needs to be tokenized without torch: {err}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return with_chat_template(tok, cfg.tokenizer, cfg.tokenizer_name)


def with_chat_template(tok, t, name: str, key: str = "policy.tokenizer"):
    """policy.tokenizer.chat_template (null: passthrough; "default": the tokenizer's; else Jinja or a .jinja
    file) and chat_template_kwargs, bound into apply_chat_template so every caller gets them, as in NeMo RL.
    `name`, `key`: the tokenizer's origin and config section, for the error when it has no template."""
    if t.chat_template is None:
        tok.chat_template = PASSTHROUGH_TEMPLATE
    elif t.chat_template.lower() != "default":
        path = Path(t.chat_template)
        tok.chat_template = path.read_text() if t.chat_template.endswith(".jinja") else t.chat_template
    require_chat_template(tok, name, key)
    if t.chat_template_kwargs:
        tok.apply_chat_template = functools.partial(tok.apply_chat_template, **t.chat_template_kwargs)
    return tok


def check_same_vocabulary(student: PolicyConfig, teacher_model: str) -> None:
    """NeMo RL's check_vocab_equality, torch-free: the teacher's token -> id map, its length and its model's
    vocab_size (the logits' last dimension) must be the student's, since the KL compares the two models' logits
    token id by token id. Raises ValueError naming what differs."""
    mine = load_tokenizer_without_torch(student)
    theirs = build_tiny_tokenizer() if teacher_model == "tiny" else PreTrainedTokenizerFast.from_pretrained(teacher_model)
    a, b = mine.get_vocab(), theirs.get_vocab()
    where = f"teacher.model_name {teacher_model!r} and the student's tokenizer {student.tokenizer_name!r}"
    if a != b:
        differ = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
        shown = ", ".join(f"{t!r}: {a.get(t)} vs {b.get(t)}" for t in differ[:3])
        raise ValueError(f"{where} map tokens to ids differently ({len(differ)} tokens, e.g. {shown}): a distillation "
                         f"teacher must share the student's tokenizer and vocabulary")
    if len(mine) != len(theirs):
        raise ValueError(f"{where} have {len(theirs)} and {len(mine)} tokens: a distillation teacher must share the "
                         f"student's vocabulary")
    sizes = _vocab_size(teacher_model, len(theirs)), _vocab_size(student.model_name, len(mine), student)
    if sizes[0] != sizes[1]:
        raise ValueError(f"{where}: the models' vocab_size (their logits' last dimension) is {sizes[0]} for the "
                         f"teacher and {sizes[1]} for the student: a distillation teacher must share it")


def _vocab_size(model: str, tokens: int, policy: PolicyConfig | None = None) -> int:
    """The model's vocab_size from its config.json (the tiny model's: its tokenizer's length), with
    policy.hf_config_overrides applied for the student, read without transformers' AutoConfig (which imports torch)."""
    if policy is not None and "vocab_size" in policy.hf_config_overrides:
        return policy.hf_config_overrides["vocab_size"]
    if model == "tiny":
        return tokens
    path = Path(model) / "config.json"
    if not path.exists():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "config.json"))
    config = json.loads(path.read_text())
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")

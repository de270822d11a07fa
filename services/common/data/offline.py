"""One record -> one SFT example or one preference pair, as NeMo RL's dataset classes read them (pure).

SFT (nemo_rl/data/datasets/response_datasets/):
    {"messages": [...], "tools": [...]}        OpenAIFormatDataset (chat_key, tool_key, system_key, system_prompt)
    {"input": ..., "output": ...}              ResponseDataset (input_key, output_key): one user turn, one answer
DPO and RM (nemo_rl/data/datasets/preference_datasets/):
    {"context": [...], "completions": [{"rank": 0, "completion": [...]}, {"rank": 1, ...}]}   PreferenceDataset
    {"prompt": ..., "chosen": ..., "rejected": ...}                                          BinaryPreferenceDataset
    (prompt_key / chosen_key / rejected_key; a prompt may be a string or a list of messages)

A record of the wrong shape (not an object, a key missing, a message that is not one) raises RowError,
which stops the run as GRPO's loader does: it is a format or key mistake, so it would hit every row.
A well-formed record that cannot train raises Dropped with the reason; the loader counts it and goes on.
prompt_file formats the first user message, as NeMo RL's get_formatted_message_log does for SFT and
preferences; NeMo RL's sft_processor and preference_preprocessor never apply system_prompt_file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.data.messages import chat_messages, check_tools, says_something
from services.common.data.rows import RowError, Templates, apply_templates


class Dropped(ValueError):
    """A well-formed record that cannot train; the message is the reason."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OfflineKeys:
    """Which columns hold what: NeMo RL's dataset keys and their defaults."""

    input_key: str = "input"
    output_key: str = "output"
    chat_key: str = "messages"
    tool_key: str = "tools"
    system_key: str | None = None
    """Column of a system message put first (OpenAIFormatDataset)."""
    system_prompt: str | None = None
    """A system message put first when the row has no system_key column (OpenAIFormatDataset)."""
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTExample:
    messages: list[dict]
    """The conversation (messages.py's shape); the loss covers the assistant messages, the last one included."""
    tools: list[dict] | None = None
    """Tool definitions for the chat template; None: the row has none."""
    where: str = ""
    """The record's file and line ("f.jsonl:3") or row ("f.parquet row 3")."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PreferenceExample:
    context: list[dict]
    """The prompt conversation both completions answer."""
    chosen: list[dict]
    """The preferred completion's messages (NeMo RL: the lower rank)."""
    rejected: list[dict]
    tools: list[dict] | None = None
    where: str = ""


def sft_example(record: object, keys: OfflineKeys, templates: Templates, where: str = "") -> SFTExample:
    record = _object(record)
    if keys.chat_key in record:
        messages = chat_messages(record[keys.chat_key], keys.chat_key)
        messages = _system(record, keys) + messages
        tools = check_tools(record.get(keys.tool_key), keys.tool_key)
    else:
        prompt, answer = (_column(record, k) for k in (keys.input_key, keys.output_key))
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        tools = None
    if not any(says_something(m) for m in messages):
        raise Dropped("no assistant turn (an SFT row needs an assistant message with text or a tool call)")
    if messages[-1]["role"] != "assistant":
        raise Dropped(f"last message not the assistant's ({messages[-1]['role']}; NeMo RL's OpenAIFormatDataset "
                      "requires the assistant's last)")
    return SFTExample(messages=_templated(messages, templates), tools=tools, where=where)


def preference_example(record: object, keys: OfflineKeys, templates: Templates, where: str = "") -> PreferenceExample:
    record = _object(record)
    if "context" in record and "completions" in record:
        context, chosen, rejected = _ranked(record)
    else:
        context, chosen, rejected = _binary(record, keys)
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if not any(says_something(m) for m in completion):
            raise Dropped(f"empty {name} (no assistant text or tool call)")
    if _same(chosen, rejected):
        raise Dropped("chosen equals rejected (nothing to prefer)")
    if not context:
        raise Dropped("no prompt (the context is empty)")
    tools = check_tools(record.get(keys.tool_key), keys.tool_key)
    return PreferenceExample(context=_templated(context, templates), chosen=chosen, rejected=rejected,
                             tools=tools, where=where)


def _binary(record: dict, keys: OfflineKeys) -> tuple[list[dict], list[dict], list[dict]]:
    """BinaryPreferenceDataset: a prompt (text or messages), chosen and rejected answers as text."""
    prompt = _field(record, keys.prompt_key)
    context = chat_messages(prompt, keys.prompt_key) if isinstance(prompt, list) else [
        {"role": "user", "content": _column(record, keys.prompt_key)}]
    answers = [[{"role": "assistant", "content": _column(record, k)}] for k in (keys.chosen_key, keys.rejected_key)]
    return context, answers[0], answers[1]


def _ranked(record: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """PreferenceDataset: exactly two completions, the lower rank preferred (preference_preprocessor)."""
    context = chat_messages(record["context"], "context")
    completions = record["completions"]
    if not isinstance(completions, list) or not all(isinstance(c, dict) for c in completions):
        raise RowError("completions must be a list of {rank, completion} objects")
    if len(completions) != 2:
        raise Dropped(f"not two completions ({len(completions)}; NeMo RL's DPO and RM take exactly two)")
    ranks = []
    for i, c in enumerate(completions):
        if not isinstance(c.get("rank"), (int, float)) or isinstance(c.get("rank"), bool):
            raise RowError(f"completions[{i}].rank must be a number, got {c.get('rank')!r}")
        ranks.append(c["rank"])
    if ranks[0] == ranks[1]:
        raise Dropped(f"tied ranks ({ranks[0]}; NeMo RL takes no ties)")
    best, worst = sorted(range(2), key=lambda i: ranks[i])
    return (context, *(chat_messages(completions[i].get("completion"), f"completions[{i}].completion")
                       for i in (best, worst)))


def _system(record: dict, keys: OfflineKeys) -> list[dict]:
    if keys.system_key is not None and keys.system_key in record:
        return [{"role": "system", "content": _column(record, keys.system_key)}]
    return [{"role": "system", "content": keys.system_prompt}] if keys.system_prompt else []


def _templated(messages: list[dict], templates: Templates) -> list[dict]:
    if templates.prompt is None or not any(m["role"] == "user" for m in messages):
        return messages
    return apply_templates(messages, Templates(prompt=templates.prompt))


def _same(a: list[dict], b: list[dict]) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _object(record: object) -> dict:
    if not isinstance(record, dict):
        raise RowError(f"a row must be a JSON object, got {type(record).__name__}")
    return record


def _field(record: dict, key: str) -> object:
    if key not in record:
        raise RowError(f"no {key!r} key (keys: {', '.join(sorted(record)) or 'none'})")
    return record[key]


def _column(record: dict, key: str) -> str:
    value = _field(record, key)
    if value is None:
        return ""  # parquet's null for a missing value: an empty text, dropped as such where it matters
    if not isinstance(value, str):
        raise RowError(f"{key!r} must be text, got {type(value).__name__}")
    return value


def over_limit(kind: str, tokens: tuple[int, ...], max_seq_length: int) -> str | None:
    """Why a tokenized example is over the sequence limit, or None. For whoever tokenizes (the chat template
    applied): `tokens` is (length,) for SFT, (chosen, rejected) for a pair. NeMo RL's own bounds: sft_processor
    masks a row of length >= max_seq_length, preference_preprocessor a pair whose longer side is > it."""
    longest = max(tokens)
    if kind == "sft" and longest >= max_seq_length:
        return f"{longest} tokens, at or over the sequence limit {max_seq_length}"
    if kind == "preference" and longest > max_seq_length:
        return f"{longest} tokens in its longer side, over the sequence limit {max_seq_length}"
    if kind not in ("sft", "preference"):
        raise ValueError(f"kind must be sft or preference, got {kind!r}")
    return None

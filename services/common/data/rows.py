"""One record -> one prompt row, as NeMo RL's dataset classes and math_hf_data_processor make it (pure).

Formats (detected per record unless input_key is set):
    {"messages": [user..., assistant]}          the last assistant message is the ground truth
    {"problem": ..., "expected_answer": ...}    OpenMathInstruct-2
    {"input": ..., "output": ...}               NeMo RL's ResponseDataset defaults
    {"responses_create_params": {...}, ...}     a NeMo Gym task row (NemoGymDataset): the prompt is its input
                                                and tools in chat form; the whole row goes in metadata.nemo_gym
A named dataset (config_data.NAMED_DATASETS) sets its own keys, dotted for nested fields.
The prompt is [system (system_prompt_file)] + user (prompt_file.format(problem), or the problem),
and metadata carries {"ground_truth": answer}, which the math environment verifies against. Rows in
the messages format may carry their own "metadata" (an environment's state), several prompt messages, and
OpenAI's tool columns: "tools" (the definitions offered), assistant "tool_calls" and "tool" results with
"tool_call_id", as NeMo RL's OpenAI-format rows have them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.messages import arguments_text

FORMATS = (("problem", "expected_answer"), ("input", "output"))


class RowError(ValueError):
    """A record that cannot become a prompt; the message says which key is missing or wrong."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Templates:
    prompt: str | None = None
    """Text with one `{}` for the problem (str.format, so `{{}}` is a literal `{}`); None: the problem as is."""
    system: str | None = None
    """Content of a system message before the prompt; None: no system message."""


def to_row(record: object, input_key: str | None, output_key: str | None, templates: Templates, *,
           answer_after: str | None = None) -> dict:
    """{"messages": prompt conversation, "metadata": {"ground_truth": ..., ...}} of one record. `answer_after`:
    the ground truth is the text after this marker in the output field (GSM8K's "#### 42")."""
    if not isinstance(record, dict):
        raise RowError(f"a row must be a JSON object, got {type(record).__name__}")
    tools: list = []
    if input_key is None and GYM_KEY in record and "messages" not in record:
        return gym_row(record)
    if input_key is None and "messages" in record:
        messages, metadata = _from_messages(record)
        tools = _tools(record)
    else:
        problem, answer = _from_columns(record, input_key, output_key)
        if answer_after is not None:
            if answer_after not in answer:
                raise RowError(f"the answer holds no {answer_after!r} before its final value")
            answer = answer.split(answer_after)[1].strip()
        messages, metadata = [{"role": "user", "content": problem}], {"ground_truth": answer}
    row = {"messages": apply_templates(messages, templates), "metadata": metadata}
    return {**row, "tools": tools} if tools else row


GYM_KEY = "responses_create_params"


def gym_row(record: dict) -> dict:
    """A NeMo Gym task row as a prompt row. The row travels whole as JSON text in metadata.nemo_gym (what NeMo
    Gym's agent server /run gets): JSON text because a Struct would turn its integers into doubles."""
    from services.common.data.offline import Dropped  # here: offline.py imports this module
    from services.common.data.responses import chat_tools, prompt_messages

    try:
        messages, tools = prompt_messages(record[GYM_KEY]), chat_tools(record[GYM_KEY]) or []
    except Dropped as err:
        raise RowError(f"a NeMo Gym row: {err}") from None
    row = {"messages": messages, "metadata": {"nemo_gym": json.dumps(record)}}
    return {**row, "tools": tools} if tools else row


def _from_columns(record: dict, input_key: str | None, output_key: str | None) -> tuple[str, str]:
    if input_key is None:
        input_key, default_out = next(((i, o) for i, o in FORMATS if i in record), (None, None))
        if input_key is None:
            raise RowError(f"no messages, problem or input key (keys: {', '.join(sorted(record)) or 'none'}); "
                           f"set input_key / output_key")
        output_key = output_key or default_out
    output_key = output_key or "output"
    values = []
    for key in (input_key, output_key):
        value = _field(record, key)
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise RowError(f"{key!r} must be text, got {type(value).__name__}")
        values.append(str(value))
    return values[0], values[1]


def _field(record: dict, key: str) -> object:
    """record[key]; a dotted key that is not a column itself walks into nested objects and lists
    ("prompt.0.content": DAPO-Math's chat-shaped records)."""
    if key in record:
        return record[key]
    node: object = record
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise RowError(f"no {key!r} key (keys: {', '.join(sorted(record)) or 'none'})")
    return node


def _from_messages(record: dict) -> tuple[list[dict], dict]:
    """NeMo RL's message format: a trailing assistant message is the ground truth, the rest the prompt."""
    messages = record["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and _is_message(m) for m in messages):
        raise RowError("messages must be a list of {role, content} objects with text content (null content only "
                       "beside tool_calls)")
    metadata = record.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RowError("metadata must be an object")
    metadata = dict(metadata)
    prompt = [{k: m[k] for k in MESSAGE_KEYS if m.get(k) is not None} for m in messages]
    for m in prompt:
        if "tool_calls" in m:
            m["tool_calls"] = [_call(c) for c in m["tool_calls"]]
    if prompt and prompt[-1]["role"] == "assistant" and not prompt[-1].get("tool_calls"):
        metadata.setdefault("ground_truth", prompt.pop()["content"])
    if not prompt:
        raise RowError("messages hold no prompt (only the assistant's answer)")
    return prompt, metadata


MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
"""What a prompt message keeps (OpenAI's fields that the chat template reads); other keys are dropped."""


def _is_message(m: dict) -> bool:
    content_ok = isinstance(m.get("content"), str) or (m.get("content") is None and bool(m.get("tool_calls")))
    return isinstance(m.get("role"), str) and content_ok and isinstance(m.get("tool_calls") or [], list)


def _call(call: object) -> dict:
    """One OpenAI tool call, its arguments as JSON text (some datasets write the object itself)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RowError("a tool call must be {id, type, function: {name, arguments}}")
    return {**call, "function": {**function, "arguments": arguments_text(function.get("arguments"))}}


def _tools(record: dict) -> list:
    """OpenAI's tool definitions of the row; checked field by field when the row becomes a DatasetRow."""
    tools = record.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowError("tools must be a list of OpenAI tool definitions ({type, function: {name, parameters}})")
    return tools


def apply_templates(messages: list[dict], templates: Templates) -> list[dict]:
    """math_hf_data_processor: prompt_file formats the first user message; system_prompt_file goes first."""
    out = [dict(m) for m in messages]
    if templates.prompt is not None:
        user = next((m for m in out if m["role"] == "user"), None)
        if user is None:
            raise RowError("prompt_file needs a user message to format")
        user["content"] = templates.prompt.format(user["content"])
    if templates.system:
        out.insert(0, {"role": "system", "content": templates.system})
    return out


def check_prompt_template(text: str) -> None:
    """Raises RowError unless `text` formats with exactly one positional field."""
    try:
        text.format("x")
    except (IndexError, KeyError, ValueError) as err:
        raise RowError(f"the prompt template must hold one {{}} for the problem (write {{{{ }}}} for a brace): "
                       f"{type(err).__name__}: {err}") from None

"""NeMo Gym task rows as Flywheel prompt rows (docs/agents.md, "NeMo Gym")."""

from __future__ import annotations

import json
from pathlib import Path


def read_tasks(path: str | Path) -> list[dict]:
    """NeMo Gym task rows (jsonl with `responses_create_params`) as Flywheel prompt rows: the chat `messages`
    and `tools` the controller and logs read, and the untouched NeMo Gym row under `nemo_gym`, which is what
    /run gets."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            params = row["responses_create_params"]
            tools = [_chat_tool(t) for t in params.get("tools") or []]
            rows.append({"messages": _messages(params), "tools": tools, "nemo_gym": row})
    return rows


def _messages(params: dict) -> list[dict]:
    items = params["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    messages = [{"role": "system", "content": params["instructions"]}] if params.get("instructions") else []
    for item in items:
        if item.get("type", "message") == "message":
            content = item["content"]
            if not isinstance(content, str):
                content = "".join(part.get("text", "") for part in content)
            messages.append({"role": item["role"], "content": content})
    return messages


def _chat_tool(tool: dict) -> dict:
    """A Responses function tool in chat's shape."""
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}

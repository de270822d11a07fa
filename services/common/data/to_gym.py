"""One Flywheel episode -> one line of NeMo Gym's rollouts.jsonl (`flywheel collect`): pure, no IO.

    prompt (chat messages, tools) + episode (messages after the prompt) + reward + named rewards
        ──▶ {"responses_create_params": {"input", "tools"}, "response": {..., "output": items}, "reward",
             "_ng_task_index", "_ng_rollout_index", "env_name", <each named reward>}

The line has the shape of NeMo Gym's `BaseVerifyResponse` (nemo_gym/base_resources_server.py), which
`ng_collect_rollouts` writes: the request, the Responses object whose `output` items are the episode, the reward,
and the verifier's extra fields at the top level. Chat messages become Responses items by the inverse of the rules
`flywheel data from-gym` reads them with (responses.py): an assistant turn's text an output message, each of its
tool calls a `function_call`, a tool result a `function_call_output` with the call's id, any other message an
input message (an environment's plain observation as the user's).
"""

from __future__ import annotations

RESERVED = ("responses_create_params", "response", "reward", "_ng_task_index", "_ng_rollout_index", "env_name")
"""Top-level keys the line owns; a named reward of one of these names is written as `metric/<name>`."""


def gym_rollout(*, prompt: list[dict], tools: list[dict] | None, episode: list[dict], reward: float,
                metrics: dict[str, float], env_name: str, model: str, task_index: int, rollout_index: int) -> dict:
    """`prompt` and `episode` are OpenAI chat messages, `tools` OpenAI chat tools; `metrics` the episode's named
    rewards (NeMo Gym's extra verify fields)."""
    params: dict = {"input": items(prompt, f"{task_index}_{rollout_index}_in")}
    flat_tools = [_tool(t) for t in tools or []]
    if flat_tools:
        params["tools"] = flat_tools
    response = {"id": f"resp_{task_index}_{rollout_index}", "object": "response", "created_at": 0, "model": model,
                "output": items(episode, f"{task_index}_{rollout_index}"), "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": flat_tools}
    line = {"responses_create_params": params, "response": response, "reward": reward,
            "_ng_task_index": task_index, "_ng_rollout_index": rollout_index, "env_name": env_name}
    for name, value in metrics.items():
        line[f"metric/{name}" if name in RESERVED else name] = value
    return line


def items(messages: list[dict], id_prefix: str) -> list[dict]:
    """Chat messages -> Responses items, in order; ids are `<kind>_<id_prefix>_<n>`."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant":
            out += _assistant(m, f"{id_prefix}_{len(out)}")
        elif m["role"] == "tool":
            out.append({"type": "function_call_output", "call_id": m.get("tool_call_id") or "",
                        "output": m.get("content") or ""})
        else:
            role = m["role"] if m["role"] in ("system", "developer", "user") else "user"
            out.append({"type": "message", "role": role, "content": m.get("content") or ""})
    return out


def _assistant(m: dict, item_id: str) -> list[dict]:
    calls = m.get("tool_calls") or []
    out = []
    if m.get("content") or not calls:
        out.append({"id": f"msg_{item_id}", "type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": m.get("content") or "", "annotations": []}]})
    for i, c in enumerate(calls):
        out.append({"id": f"fc_{item_id}_{i}", "type": "function_call", "status": "completed",
                    "call_id": c.get("id") or f"call_{item_id}_{i}", "name": c["function"]["name"],
                    "arguments": c["function"].get("arguments") or "{}"})
    return out


def _tool(t: dict) -> dict:
    """OpenAI chat tool {"type": "function", "function": {...}} -> Responses' flat function tool."""
    fn = t.get("function", t)
    return {"type": "function", "name": fn["name"], "description": fn.get("description"),
            "parameters": fn.get("parameters") or {"type": "object", "properties": {}}, "strict": False}

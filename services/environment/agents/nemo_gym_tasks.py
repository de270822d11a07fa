"""NeMo Gym task rows as Flywheel prompt rows (docs/agents.md, "NeMo Gym").

The conversion is the dataset loader's (services/common/data/rows.py, `gym_row`), so a NeMo Gym jsonl given
as an environment's dataset and one read here give the same prompt."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.data.rows import gym_row


def read_tasks(path: str | Path) -> list[dict]:
    """NeMo Gym task rows (jsonl with `responses_create_params`) as Flywheel prompt rows: the chat `messages`
    and `tools` the controller and logs read, and the NeMo Gym row itself under `nemo_gym`, which is what
    /run gets."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = gym_row(json.loads(line))
            rows.append({"messages": row["messages"], "tools": row.get("tools", []),
                         "nemo_gym": json.loads(row["metadata"]["nemo_gym"])})
    return rows


def task_row(task: dict) -> dict:
    """The NeMo Gym row of an episode's task: `nemo_gym` as read_tasks gives it, or as the JSON text a dataset
    row carries through the controller (its metadata), or the task itself when it is a NeMo Gym row."""
    row = task.get("nemo_gym", task)
    return json.loads(row) if isinstance(row, str) else row

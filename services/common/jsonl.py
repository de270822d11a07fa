"""Reading the run's JSONL files (metrics, batches, validation, restarts) while their writer appends to them, and
writing a JSONL file whole."""

import json
from pathlib import Path


def complete_rows(text: str) -> list[dict]:
    """The rows of `text` that are whole. A reader can run while a row is being written, so what follows the last
    newline is a row not yet complete: it is left for the next read, never parsed."""
    return [json.loads(line) for line in text.rpartition("\n")[0].splitlines() if line.strip()]


def read_rows(path: Path) -> list[dict]:
    """`complete_rows` of the file at `path`; none when it does not exist yet."""
    return complete_rows(path.read_text()) if path.is_file() else []


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """`rows` as the file at `path`, one JSON object a line, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

"""Records from where NeMo RL reads them: JSONL, JSON, parquet, a `datasets` directory, a hub name.

Each record comes with where it came from ("file:line" for JSONL, "file row N" otherwise), so a bad
one is named exactly. parquet, saved datasets and the hub go through the `datasets` package, imported
only then (it imports no torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class SourceError(ValueError):
    """A dataset that cannot be read at all; the message names the path."""


def records(path: str, *, subset: str | None = None, split: str | None = None) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of `path`: a file, a saved dataset directory, or a hub id."""
    p = Path(path)
    if p.is_file() and p.suffix == ".jsonl":
        yield from _jsonl(p)
    elif p.is_file() and p.suffix == ".json":
        yield from _json(p)
    elif p.is_file() and p.suffix == ".parquet":
        yield from _numbered(str(p), _hf("parquet", data_files=str(p), split="train"))
    elif p.is_dir():
        yield from _numbered(str(p), _saved(p, split))
    elif p.exists() or "/" not in path or path.startswith((".", "/")):
        raise SourceError(f"{path}: no such dataset (a .jsonl, .json or .parquet file, a saved `datasets` "
                          f"directory, or a hub id)")
    else:
        yield from _numbered(path, _hf(path, name=subset, split=split or "train"))


def _jsonl(p: Path) -> Iterator[tuple[str, object]]:
    with p.open("rb") as f:  # bytes, decoded line by line: a line that is not UTF-8 is named
        for n, raw in enumerate(f, 1):
            line = decode_utf8(raw, f"{p}:{n}")
            if line.strip():
                try:
                    yield f"{p}:{n}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise SourceError(f"{p}:{n}: not valid JSON: {err.msg} (column {err.colno})") from None


def _json(p: Path) -> Iterator[tuple[str, object]]:
    try:
        data = json.loads(decode_utf8(p.read_bytes(), str(p)))
    except json.JSONDecodeError as err:
        raise SourceError(f"{p}:{err.lineno}: not valid JSON: {err.msg}") from None
    if not isinstance(data, list):
        raise SourceError(f"{p}: a .json dataset must be a list of objects")
    yield from _numbered(str(p), data)


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as UTF-8 (JSON's encoding), or an error naming `where` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SourceError(f"{where}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})") from None


def _numbered(where: str, rows) -> Iterator[tuple[str, object]]:
    for n, row in enumerate(rows, 1):
        yield f"{where} row {n}", row


def _datasets():
    try:
        import datasets
    except ImportError:
        raise SourceError("reading parquet, saved datasets or the hub needs the `datasets` package") from None
    return datasets


def _hf(path: str, **kwargs):
    datasets = _datasets()
    try:
        return datasets.load_dataset(path, **kwargs)
    except Exception as err:  # the hub unreachable, a missing split, a bad file: one line naming the source
        raise SourceError(f"{path}: cannot load with datasets.load_dataset: {type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''}") from None


def _saved(p: Path, split: str | None):
    datasets = _datasets()
    try:
        data = datasets.load_from_disk(str(p))
    except Exception as err:
        raise SourceError(f"{p}: not a dataset saved with save_to_disk: {type(err).__name__}: {err}") from None
    if isinstance(data, datasets.DatasetDict):
        names = list(data)
        chosen = split or ("train" if "train" in names else names[0] if len(names) == 1 else None)
        if chosen not in data:
            raise SourceError(f"{p}: split {chosen!r} not in the saved dataset (splits: {', '.join(names)}); set split")
        data = data[chosen]
    return data

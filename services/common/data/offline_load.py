"""data.train / data.validation -> SFT examples or preference pairs, through GRPO's sources (JSONL, JSON,
parquet, saved `datasets`, hub ids) and prompt files.

    DatasetConfig ──sources.records──▶ (where, record) ──offline.py──▶ SFTExample | PreferenceExample
                                                                  └──▶ Drop(where, reason), counted

A record of the wrong shape stops the run (DataError naming key, file and line, as GRPO's loader does);
a well-formed record that cannot train is dropped and named; a dataset whose every row is dropped is an
error. Token lengths are checked later, by whoever tokenizes (offline.over_limit). Nothing here imports torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Literal

from services.common.config import FlywheelConfig
from services.common.config_data import DatasetConfig
from services.common.data.loader import DataError, named_sets, read_text_file
from services.common.data.offline import (Dropped, OfflineKeys, PreferenceExample, SFTExample,
                                              preference_example, sft_example)
from services.common.data.plan import holdout
from services.common.data.rows import RowError, Templates, check_prompt_template
from services.common.data.sources import SourceError, records

Kind = Literal["sft", "preference"]
"""sft: SFT rows; preference: pairs, for DPO and RM alike."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Drop:
    where: str
    """The record's file and line, or row."""
    reason: str


@dataclass(kw_only=True, slots=True)
class OfflineSet:
    source: str
    """The config key the rows came from (data.train, data.validation.1, ...)."""
    examples: list[SFTExample | PreferenceExample] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What was kept and dropped, one line per drop, in the style of the other data notes."""
        out = [f"data: {self.source}: {d.where}: dropped: {d.reason}" for d in self.drops]
        counts = Counter(reason_kind(d.reason) for d in self.drops)
        tail = f" ({len(self.drops)} dropped: {', '.join(f'{n} {r}' for r, n in counts.items())})" if counts else ""
        return [*out, f"data: {self.source}: {len(self.examples)} examples kept{tail}"]


@dataclass(kw_only=True, slots=True)
class LoadedOffline:
    train: list[OfflineSet]
    validation: list[OfflineSet]
    notes: list[str] = field(default_factory=list)


def read_offline(key: str, path: str, kind: Kind, keys: OfflineKeys = OfflineKeys(), templates: Templates = Templates(),
                 *, subset: str | None = None, split: str | None = None) -> OfflineSet:
    """Every record of `path` as `kind`; DataError for a malformed record, an unreadable or empty source, or
    a source whose every record is dropped."""
    convert = sft_example if kind == "sft" else preference_example
    out = OfflineSet(source=key)
    try:
        for where, record in records(path, subset=subset, split=split):
            try:
                out.examples.append(convert(record, keys, templates, where))
            except Dropped as why:
                out.drops.append(Drop(where=where, reason=str(why)))
            except RowError as err:
                raise DataError(f"{key}: {where}: {err}") from None
    except SourceError as err:
        raise DataError(f"{key}: {err}") from None
    if not out.drops and not out.examples:
        raise DataError(f"{key}: {path}: the dataset is empty")
    if not out.examples:
        first = out.drops[0]
        raise DataError(f"{key}: {path}: every row was dropped ({len(out.drops)}; the first, {first.where}: "
                        f"{first.reason})")
    return out


def keys_of(ds: DatasetConfig) -> OfflineKeys:
    """NeMo RL's key names from a dataset entry: each OfflineKeys field the entry sets (prompt_key, chat_key, ...
    where the config schema has them), the default for the rest."""
    given = {f.name: getattr(ds, f.name, None) for f in fields(OfflineKeys)}
    return OfflineKeys(**{k: v for k, v in given.items() if v is not None})


def load_offline_set(key: str, ds: DatasetConfig, kind: Kind) -> OfflineSet:
    if not ds.data_path:
        raise DataError(f"{key}.data_path: not set (a .jsonl/.json/.parquet file, a saved dataset, or a hub id; "
                        f"NeMo RL's named SFT and preference datasets are not read here)")
    prompt = read_text_file(f"{key}.prompt_file", ds.prompt_file)
    if prompt is not None:
        try:
            check_prompt_template(prompt)
        except RowError as err:
            raise DataError(f"{key}.prompt_file: {ds.prompt_file}: {err}") from None
    loaded = read_offline(key, ds.data_path, kind, keys_of(ds), Templates(prompt=prompt), subset=ds.subset,
                          split=ds.split)
    loaded.examples *= ds.repeat
    return loaded


def load_offline(cfg: FlywheelConfig, kind: Kind) -> LoadedOffline:
    """data.train and data.validation as `kind`; DataError listing every dataset that failed."""
    problems: list[str] = []
    out = LoadedOffline(train=[], validation=[])
    entries = [*(("train", k, d) for k, d in named_sets(cfg.data.train_sets(), "data.train")),
               *(("validation", k, d) for k, d in named_sets(cfg.data.validation_sets(), "data.validation"))]
    for group, key, ds in entries:
        try:
            loaded = load_offline_set(key, ds, kind)
        except DataError as err:
            problems.append(str(err))
            continue
        out.notes += _notes(key, ds, kind)
        if group == "validation":
            out.validation.append(loaded)
            continue
        keep, held = holdout(len(loaded.examples), ds.split_validation_size if kind == "sft" else 0.0, ds.seed)
        out.train.append(OfflineSet(source=key, examples=[loaded.examples[i] for i in keep], drops=loaded.drops))
        if held:
            out.validation.append(OfflineSet(source=f"{key} (split_validation_size)",
                                             examples=[loaded.examples[i] for i in held]))
    if problems:
        raise DataError("\n".join(problems))
    return out


def _notes(key: str, ds: DatasetConfig, kind: Kind) -> list[str]:
    notes = []
    if ds.system_prompt_file:
        notes.append(f"data: {key}: system_prompt_file not applied: NeMo RL's sft_processor and "
                     "preference_preprocessor apply prompt_file only (SFT rows: use system_prompt or system_key)")
    if kind == "preference" and ds.split_validation_size:
        notes.append(f"data: {key}: split_validation_size ignored: NeMo RL's preference datasets take no hold-out")
    return notes


def reason_kind(reason: str) -> str:
    """A drop reason without its detail (the part in parentheses), to count drops by kind."""
    return reason.split(" (")[0]

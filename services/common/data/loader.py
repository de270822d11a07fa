"""data.* -> prompt rows for training and validation; every failure is one DataError naming key, file, line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from services.common.config import FlywheelConfig
from services.common.config_data import NAMED_DATASETS, DatasetConfig
from services.common.messages import dataset_row
from services.common.pb.flywheel.v1 import types_pb2
from services.common.data.plan import holdout, planned_steps
from services.common.data.rows import RowError, Templates, check_prompt_template, to_row
from services.common.data.sources import SourceError, decode_utf8, records


class DataError(ValueError):
    """A dataset, prompt file or row that cannot be used; one line per problem."""


@dataclass(kw_only=True, slots=True)
class PromptSet:
    env_name: str
    """The environment (built-in kind) that scores these prompts."""
    rows: list[types_pb2.DatasetRow] = field(default_factory=list)
    source: str = ""
    """Where the rows came from, for messages."""


@dataclass(kw_only=True, slots=True)
class LoadedData:
    train: list[PromptSet]
    validation: list[PromptSet]
    notes: list[str] = field(default_factory=list)
    """Settings read and not applied, each with why."""

    @property
    def train_rows(self) -> int:
        return sum(len(s.rows) for s in self.train)


def load_data(cfg: FlywheelConfig) -> LoadedData:
    """Reads data.train and data.validation. Raises DataError listing every dataset that failed."""
    problems: list[str] = []
    train, validation, notes = [], [], []
    for key, ds in named_sets(cfg.data.train_sets(), "data.train"):
        try:
            rows = _rows(key, ds)
            named = NAMED_DATASETS.get(ds.dataset_name)
            held_out = ds.split_validation_size if named is None or named.holds_out else 0.0
            if held_out != ds.split_validation_size:
                notes.append(f"data: {key}: split_validation_size ignored: NeMo RL's {ds.dataset_name} takes no "
                             "hold-out (give it a validation set instead)")
            keep, held = holdout(len(rows), held_out, ds.seed)
            train.append(_set(ds, [rows[i] for i in keep], key))
            if held:
                validation.append(_set(ds, [rows[i] for i in held], f"{key} (split_validation_size)"))
        except DataError as err:
            problems.append(str(err))
    for key, ds in named_sets(cfg.data.validation_sets(), "data.validation"):
        try:
            validation.append(_set(ds, _rows(key, ds), key))
        except DataError as err:
            problems.append(str(err))
    if problems:
        raise DataError("\n".join(problems))
    return LoadedData(train=train, validation=validation, notes=notes)


def plan_steps(cfg: FlywheelConfig, data: LoadedData) -> int:
    """grpo.max_num_steps bounded by grpo.max_num_epochs over data.train (NeMo RL drops each epoch's last partial step)."""
    g = cfg.grpo
    if not data.train:
        return g.max_num_steps
    steps = planned_steps(g.max_num_steps, g.max_num_epochs, data.train_rows, g.num_prompts_per_step)
    if steps == 0:
        raise DataError(f"data.train: {data.train_rows} rows make no step of grpo.num_prompts_per_step="
                        f"{g.num_prompts_per_step}")
    return steps


def plan_config(cfg: FlywheelConfig) -> tuple[FlywheelConfig, list[str]]:
    """(cfg with grpo.max_num_steps bounded by the epochs, lines saying what was read and decided)."""
    data = load_data(cfg)
    steps = plan_steps(cfg, data)
    lines = [f"data: {s.source}: {len(s.rows)} prompts for environment {s.env_name}" for s in data.train]
    lines += [f"data: {s.source}: {len(s.rows)} validation prompts" for s in data.validation]
    lines += data.notes
    if steps != cfg.grpo.max_num_steps:
        lines.append(f"grpo.max_num_steps {cfg.grpo.max_num_steps} -> {steps}: grpo.max_num_epochs="
                     f"{cfg.grpo.max_num_epochs} over {data.train_rows} prompts, {cfg.grpo.num_prompts_per_step} per step")
        cfg = cfg.model_copy(deep=True)
        cfg.grpo.max_num_steps = steps
    return cfg, lines


def named_sets(sets: list[DatasetConfig], key: str):
    """(config key, entry) per dataset: `key` alone for one, `key.i` for each of a list."""
    return [(key if len(sets) == 1 else f"{key}.{i}", ds) for i, ds in enumerate(sets)]


def _set(ds: DatasetConfig, rows: list, key: str) -> PromptSet:
    return PromptSet(env_name=ds.env_name or "math", rows=rows, source=key)


def _rows(key: str, ds: DatasetConfig) -> list[types_pb2.DatasetRow]:
    templates = Templates(prompt=read_text_file(f"{key}.prompt_file", ds.prompt_file),
                          system=read_text_file(f"{key}.system_prompt_file", ds.system_prompt_file))
    if templates.prompt is not None:
        try:
            check_prompt_template(templates.prompt)
        except RowError as err:
            raise DataError(f"{key}.prompt_file: {ds.prompt_file}: {err}") from None
    named = NAMED_DATASETS.get(ds.dataset_name)
    path = ds.data_path or (named.hub_id if named else None)
    if not path:
        raise DataError(f"{key}.data_path: not set (a .jsonl/.json/.parquet file, a saved dataset, or a hub id)")
    if named is None:
        rows = _convert(key, path, templates, ds.input_key, ds.output_key, subset=ds.subset, split=ds.split)
    else:
        rows = _convert(key, path, templates, ds.input_key or named.input_key, ds.output_key or named.output_key,
                        subset=ds.subset or named.subset, split=ds.split or named.split,
                        answer_after=named.answer_after)
    return rows * ds.repeat


def load_rows(path: str) -> list[types_pb2.DatasetRow]:
    """An environment's own dataset (environments[].dataset, SubmitEnvironment jsonl_path): any format, no template."""
    return _convert("dataset", path, Templates(), None, None)


def _convert(key: str, path: str, templates: Templates, input_key: str | None, output_key: str | None,
             *, subset: str | None = None, split: str | None = None, answer_after: str | None = None
             ) -> list[types_pb2.DatasetRow]:
    out = []
    try:
        for where, record in records(path, subset=subset, split=split):
            try:
                row = to_row(record, input_key, output_key, templates, answer_after=answer_after)
                out.append(dataset_row(row))
            except (RowError, json_format.ParseError) as err:
                raise DataError(f"{key}: {where}: {err}") from None
    except SourceError as err:
        raise DataError(f"{key}: {err}") from None
    if not out:
        raise DataError(f"{key}: {path}: the dataset is empty")
    return out


def read_text_file(key: str, path: str | None) -> str | None:
    """A prompt file's text (None for no path); DataError naming `key` when it cannot be read."""
    if path is None:
        return None
    try:
        return decode_utf8(Path(path).read_bytes(), f"{key}: {path}")
    except OSError as err:
        raise DataError(f"{key}: {path}: {err.strerror or err}") from None
    except SourceError as err:
        raise DataError(str(err)) from None

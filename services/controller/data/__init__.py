"""Datasets for a run, the way NeMo RL reads them: sources, row formats, prompt templates, epochs.

    data.train / data.validation (DatasetConfig) ──sources.py──▶ records (file, line) ──rows.py──▶ DatasetRow
    DatasetRow list ──plan.py──▶ which row each (target step, slot) gets: a seeded shuffle per epoch

Everything here reads files only when asked (load_data), never imports torch, and reports a bad
row or a missing file as one DataError naming the config key, the file and the line.
"""

from services.controller.data.loader import (DataError, LoadedData, PromptSet, load_data, load_rows, plan_config,
                                             plan_steps)

__all__ = ["DataError", "LoadedData", "PromptSet", "load_data", "load_rows", "plan_config", "plan_steps"]

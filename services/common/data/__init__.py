"""Datasets for a run, the way NeMo RL reads them: sources, row formats, prompt templates, epochs.

    data.train / data.validation (DatasetConfig) ──sources.py──▶ records (file, line) ──rows.py──▶ DatasetRow (GRPO)
                                                                                   └──offline.py──▶ SFTExample,
                                                                                       PreferenceExample (SFT, DPO, RM)
    DatasetRow list ──plan.py──▶ which row each (target step, slot) gets: a seeded shuffle per epoch
    NeMo Gym rollouts.jsonl ──from_gym.py (responses.py)──▶ an SFT or DPO dataset file (`flywheel data from-gym`)

Everything here reads files only when asked (load_data, load_offline), never imports torch, and reports a bad
row or a missing file as one DataError naming the config key, the file and the line; offline rows that are
well formed and cannot train are dropped, each named with its reason.
"""

from services.common.data.loader import (DataError, LoadedData, PromptSet, load_data, load_rows, plan_config,
                                             plan_steps)
from services.common.data.offline import OfflineKeys, PreferenceExample, SFTExample, over_limit
from services.common.data.offline_load import Drop, LoadedOffline, OfflineSet, load_offline, read_offline

__all__ = ["DataError", "Drop", "LoadedData", "LoadedOffline", "OfflineKeys", "OfflineSet", "PreferenceExample",
           "PromptSet", "SFTExample", "load_data", "load_offline", "load_rows", "over_limit", "plan_config",
           "plan_steps", "read_offline"]

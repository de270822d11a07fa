"""Config sections for what a run reads and writes: NeMo RL's `data`, `policy.tokenizer`, `env`, `logger`.

Same key names and meanings as NeMo RL (`nemo_rl/data/__init__.py::DataConfig`,
`ResponseDatasetConfig`; `examples/configs/grpo_math_1B.yaml`). services/common/data/ reads
the datasets these describe. No torch, no IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from services.common.config_base import Section

@dataclass(frozen=True, slots=True)
class NamedDataset:
    """A dataset NeMo RL knows by name (nemo_rl/data/datasets/response_datasets/): where it is on the hub and
    which fields of its records hold the problem and the answer. A dotted key walks into nested fields."""

    hub_id: str
    split: str
    input_key: str
    output_key: str
    subset: str | None = None
    answer_after: str | None = None
    """The answer is the text after this marker (GSM8K's "#### 42")."""
    holds_out: bool = False
    """Whether split_validation_size applies: NeMo RL's class for this dataset splits it, or ignores the key."""


_GSM8K = NamedDataset("openai/gsm8k", "train", "question", "answer", subset="main", answer_after="####")
_DAPO = dict(input_key="prompt.0.content", output_key="reward_model.ground_truth")
NAMED_DATASETS = {
    "OpenMathInstruct-2": NamedDataset("nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer",
                                       holds_out=True),
    "DAPOMath17K": NamedDataset("BytedTsinghua-SIA/DAPO-Math-17k", "train", **_DAPO),
    "DAPOMathAIME2024": NamedDataset("BytedTsinghua-SIA/AIME-2024", "train", **_DAPO),
    "DeepScaler": NamedDataset("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer"),
    "AIME2024": NamedDataset("HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "gsm8k": _GSM8K,
    "GSM8K": _GSM8K,
}
"""NeMo RL dataset names Flywheel reads (from the hub where it is reachable, or from data_path)."""
LOCAL_COPY_ONLY = ("squad", "HelpSteer3")
"""The datasets of NeMo RL's sft.yaml, dpo.yaml and rm.yaml: read from data_path only, already in the row formats
services/common/data/offline.py reads (the name stays, e.g. for the logger names that interpolate it)."""


class DatasetConfig(Section):
    """One dataset (NeMo RL ResponseDatasetConfig). Unset fields take `data.default`'s."""

    dataset_name: str | None = None
    """A name in NAMED_DATASETS (read from the hub where it is reachable), or ResponseDataset / null with data_path."""
    data_path: str | None = None
    """A local .jsonl, .json or .parquet file, a `datasets` directory saved to disk, or a hub dataset id. With a
    named dataset: a local copy of it, read the same way."""
    input_key: str | None = None
    """Column of the problem text; null detects messages, problem or input."""
    output_key: str | None = None
    """Column of the reference answer (ground truth); null detects expected_answer or output."""
    subset: str | None = None
    """Hub dataset configuration name."""
    split: str | None = None
    """Split of a hub dataset or a saved DatasetDict; null takes train (or the only split)."""
    split_validation_size: float = Field(0.0, ge=0, lt=1)
    """Fraction of this dataset held out for validation (after a seeded shuffle)."""
    seed: int = 42
    """Seed of the train/validation split."""
    prompt_file: str | None = None
    """A template with one `{}` for the problem (NeMo RL's cot.txt); null uses the problem as it is."""
    system_prompt_file: str | None = None
    """Text of a system message put before the prompt; null adds none."""
    processor: Literal["math_hf_data_processor", "sft_processor"] | None = None
    """NeMo RL's math processor: prompt_file and system_prompt_file applied, answer as ground_truth;
    sft_processor (sft.yaml's): what an SFT run does with its rows anyway (services/common/data/offline.py)."""
    env_name: str | None = None
    """The environment that scores this dataset (a built-in kind, e.g. math)."""
    repeat: int = Field(1, gt=0)
    """The rows, this many times over (NeMo RL's AIME datasets): AIME's 30 problems repeated 16 times give a
    validation accuracy averaged over 16 samples of each."""

    @model_validator(mode="after")
    def _known_source(self) -> DatasetConfig:
        name = self.dataset_name
        if name in LOCAL_COPY_ONLY and not self.data_path:
            raise ValueError(f"dataset_name {name!r}: reading it from the hub is not built; give data_path, a local "
                             f"copy in NeMo RL's row format (SFT messages or input/output; prompt/chosen/rejected)")
        if name not in (None, "ResponseDataset") and name not in NAMED_DATASETS and name not in LOCAL_COPY_ONLY:
            raise ValueError(f"dataset_name {name!r} is not built; known: ResponseDataset (with data_path), "
                             f"{', '.join(NAMED_DATASETS)}")
        return self


def _merged(default: dict, entry: Any) -> Any:
    if isinstance(entry, dict):
        return {**default, **{k: v for k, v in entry.items()}}
    if isinstance(entry, list):
        return [_merged(default, e) for e in entry]
    return entry


class DataConfig(Section):
    """NeMo RL `data`: training and validation datasets, their defaults, shuffling."""

    shuffle: bool = True
    """Shuffle the training rows every epoch (seeded by run.seed and the epoch)."""
    train: DatasetConfig | list[DatasetConfig] | None = None
    """The training dataset(s); a list is concatenated. Null: the `environments` list is the only source."""
    validation: DatasetConfig | list[DatasetConfig] | None = None
    """Validation dataset(s), besides any train split_validation_size hold-out."""
    default: DatasetConfig | None = None
    """Values every train/validation entry takes for the fields it leaves unset."""
    max_input_seq_length: int | None = Field(None, gt=0)
    """A training prompt of this many tokens or more (chat template applied) is kept out of the loss, as NeMo RL's
    processors do (loss_multiplier 0): rollout generates nothing for it and its completions are empty, truncated
    and scored 0. Null: policy.max_total_sequence_length, where no token would fit anyway."""

    @model_validator(mode="before")
    @classmethod
    def _apply_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("default"), dict):
            data = dict(data)
            for key in ("train", "validation"):
                data[key] = _merged(data["default"], data.get(key))
        return data

    def train_sets(self) -> list[DatasetConfig]:
        return [] if self.train is None else self.train if isinstance(self.train, list) else [self.train]

    def validation_sets(self) -> list[DatasetConfig]:
        v = self.validation
        return [] if v is None else v if isinstance(v, list) else [v]


class TokenizerConfig(Section):
    """NeMo RL `policy.tokenizer`."""

    name: str | None = None
    """A Hugging Face id or local path of the tokenizer, when it is not the model's (null: the model's), e.g. an
    instruct model's tokenizer and chat template for its base model. Trainer, rollout and vLLM all load it."""
    chat_template: str | None = "default"
    """"default": the tokenizer's own; null: no template, the messages' text joined (base models); else a Jinja template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments to the chat template, e.g. {enable_thinking: true}."""


class MathEnvConfig(Section):
    """NeMo RL `env.math`."""

    num_workers: int = Field(2, gt=0)
    """Verifier processes of the math environment."""
    math_verify_impl: Literal["hf_math_verify", "dapo_math_verify"] = "hf_math_verify"
    """hf_math_verify: math_verify on the boxed ground truth; dapo_math_verify: DAPO's check of the last
    "Answer: ..." line, as normalized strings (NeMo RL's DAPO recipes)."""


class MathMultiRewardEnvConfig(Section):
    """NeMo RL `env.math_multi_reward` (its GDPO recipes): correctness, integer and format components."""

    num_workers: int = Field(1, gt=0)
    """NeMo RL's verifier actors; the checks are string comparisons and run in the environment's process."""
    math_verify_impl: Literal["hf_math_verify"] = "hf_math_verify"


class SlidingPuzzleEnvConfig(Section):
    """The sliding_puzzle environment's generated boards; NeMo RL's `env.sliding_puzzle_game.cfg` moves here."""

    size: int = Field(3, ge=2)
    """The largest board (size x size); each prompt draws 2 up to it. NeMo RL: cfg.game_config.size."""
    shuffle_moves: int = Field(4, ge=1)
    """The most random moves a board is from solved; each prompt draws 1 up to it.
    NeMo RL: cfg.game_config.shuffle_moves."""
    max_moves: int = Field(0, ge=0)
    """Moves allowed per episode; 0 = twice the board's own shuffle moves, plus 4. NeMo RL: cfg.max_moves."""


class RewardModelTypeConfig(Section):
    """NeMo RL `env.reward_model.reward_model_cfg`."""

    enabled: bool = True
    reward_model_type: Literal["bradley_terry"] = "bradley_terry"
    """A sequence-classification model with one output: the score of the whole conversation."""


class RewardModelEnvConfig(Section):
    """NeMo RL `env.reward_model`: the environment kind reward_model scores each whole conversation (prompt and
    response, through the reward model's own chat template) with a Bradley-Terry reward model. `flywheel serve
    reward_model` hosts it (services/rollout/reward_model.py); the environment service forwards to it."""

    model_name: str | None = None
    """A Hugging Face id or local path of a sequence-classification model with one label (e.g.
    Skywork/Skywork-Reward-V2-Qwen3-0.6B); "tiny": a random one built here, for tests. Required by the kind."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """The reward model's tokenizer (null name: the model's) and chat template (null: the messages' text joined)."""
    precision: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    batch_size: int = Field(32, gt=0)
    """Conversations scored in one forward."""
    max_model_len: int = Field(2048, gt=0)
    """Tokens of a conversation scored at most; a longer one keeps its last max_model_len (the response's end)."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of one Step call to the reward-model server (it waits for the server to come up within it)."""
    reward_model_cfg: RewardModelTypeConfig = RewardModelTypeConfig()

    @model_validator(mode="after")
    def _enabled(self) -> RewardModelEnvConfig:
        if not self.reward_model_cfg.enabled:
            raise ValueError("reward_model_cfg.enabled: false leaves env.reward_model nothing to score with")
        return self


class EnvConfig(Section):
    """NeMo RL `env`: settings of built-in environments."""

    math: MathEnvConfig = MathEnvConfig()
    math_multi_reward: MathMultiRewardEnvConfig = MathMultiRewardEnvConfig()
    sliding_puzzle: SlidingPuzzleEnvConfig = SlidingPuzzleEnvConfig()
    reward_model: RewardModelEnvConfig = RewardModelEnvConfig()


class WandbConfig(Section):
    project: str = "flywheel"
    name: str = ""
    """Run name; empty = run.name."""


class MlflowConfig(Section):
    experiment_name: str = "flywheel"
    run_name: str = ""
    """Run name; empty = run.name."""
    tracking_uri: str = ""
    """Empty = MLflow's default (./mlruns)."""


class LoggerConfig(Section):
    """NeMo RL `logger`. TensorBoard and <run_dir>/metrics.jsonl are always written."""

    log_dir: str = "logs"
    """Under run.run_dir: TensorBoard events go to <log_dir>/tensorboard."""
    num_val_samples_to_print: int = Field(0, ge=0)
    """Validation samples (prompt, response, reward) printed to the controller's log each validation."""
    wandb_enabled: bool = False
    mlflow_enabled: bool = False
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()


"""The typed config tree shared by every service.

One YAML file (or none: the embedded default) plus dotted CLI overrides such as
`grpo.max_staleness=2` resolve into a `FlywheelConfig`. Section and key names follow
NeMo RL's `grpo`, `loss_fn` and `policy` sections where they exist, so a NeMo RL GRPO
config ports with small edits (docs/nemo_rl_mapping.md). This module imports no torch:
controller, replay and environment load it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class RunConfig(Section):
    name: str = "flywheel"
    """Run id; it tags logs, metrics and NATS subjects."""
    run_dir: str = ""
    """Directory for config.yaml, metrics.jsonl and checkpoints; empty means a fresh one under ./runs."""
    seed: int = 42
    """Seed for data order, sampling and model init."""


class RewardShapingConfig(Section):
    """DAPO overlong reward shaping (NeMo RL `grpo.reward_shaping`)."""

    enabled: bool = False
    overlong_buffer_length: int = Field(128, ge=0)
    """Tokens before `max_response_length` where the penalty ramps in."""
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    """Penalty at `max_response_length`; linear inside the buffer."""
    max_response_length: int = Field(512, gt=0)
    """Response length (tokens) at which the full penalty applies."""


class GRPOConfig(Section):
    num_prompts_per_step: int = Field(16, gt=0)
    """Prompt groups in one optimizer step."""
    num_generations_per_prompt: int = Field(16, gt=0)
    """Group size G: completions sampled per prompt."""
    max_num_steps: int = Field(120, gt=0)
    """Optimizer steps in the run."""
    max_staleness: int = Field(1, ge=0)
    """k: step s may use groups with s - version_start <= k. NeMo RL's max_trajectory_age_steps; 0 is synchronous GRPO."""
    max_rollout_turns: int = Field(1, gt=0)
    """Environment turns per episode."""
    normalize_rewards: bool = True
    """Divide advantages by the group's reward std (where std > 0)."""
    use_leave_one_out_baseline: bool = True
    """RLOO baseline: the mean of the other samples of the group."""
    advantage_clip_low: float | None = None
    """Clamp advantages below this value after normalization; null disables."""
    advantage_clip_high: float | None = None
    """Clamp advantages above this value after normalization; null disables."""
    use_dynamic_sampling: bool = False
    """DAPO: drop zero-variance groups and lease more prompts to refill the step."""
    dynamic_sampling_max_gen_batches: int = Field(10, gt=0)
    """Most extra leases per step dynamic sampling may ask for."""
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    overlong_filtering: bool = False
    """Truncated samples get zero loss weight."""

    @model_validator(mode="after")
    def _dynamic_sampling_not_built(self) -> GRPOConfig:
        if self.use_dynamic_sampling:  # refusing beats silently training without it
            raise ValueError("use_dynamic_sampling is not supported yet (the zero-variance filter exists, "
                             "refilling the step from replay does not)")
        return self

    @model_validator(mode="after")
    def _clip_bounds_ordered(self) -> GRPOConfig:
        low, high = self.advantage_clip_low, self.advantage_clip_high
        if low is not None and high is not None and low > high:
            raise ValueError("advantage_clip_low must be <= advantage_clip_high")
        return self


class LossConfig(Section):
    """NeMo RL `loss_fn` (ClippedPGLossConfig): same names. Defaults differ in two places, on purpose:
    no reference KL (beta 0) and importance-sampling correction on (async needs it)."""

    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    """beta; 0 skips the reference model."""
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """Schulman KL estimator of KL(pi_theta || pi_ref): k1, k2 or k3."""
    kl_input_clamp_value: float | None = 20.0
    """Clamp of log(pi_ref / pi_theta) before the estimator; null disables."""
    kl_output_clamp_value: float | None = 10.0
    """Clamp of the per-token KL estimate; null disables."""
    ratio_clip_min: float = Field(0.2, ge=0)
    """epsilon_low: the ratio is clipped below at 1 - ratio_clip_min."""
    ratio_clip_max: float = Field(0.2, ge=0)
    """epsilon_high: the ratio is clipped above at 1 + ratio_clip_max (DAPO clip-higher when larger)."""
    ratio_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 for negative advantages; null disables."""
    use_on_policy_kl_approximation: bool = False
    """Weight the KL by exp(current - generation logprobs), as the samples came from the generator."""
    use_importance_sampling_correction: bool = True
    """Weight by exp(prev - generation logprobs): corrects for the engine/trainer mismatch and staleness."""
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """tis clamps the weights, icepop zeroes out-of-bounds tokens, seq-mask-tis zeroes out-of-bounds sequences."""
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0)
    """Upper bound of the importance weight (of its geometric mean per sequence for seq-mask-tis)."""
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0)
    """Lower bound; tis defaults it to 0, icepop and seq-mask-tis need it."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one length-normalized ratio per sequence; needs token_level_loss=false."""
    token_level_loss: bool = True
    """Average over the step's valid tokens (true) or over sequences (false)."""
    force_on_policy_ratio: bool = False
    """Use sg(current) for prev logprobs: ratio 1 in value, gradients kept (one update per rollout)."""
    disable_ppo_ratio: bool = False
    """REINFORCE/RLOO: the surrogate is -A * logprob, no ratio and no clipping."""

    @model_validator(mode="after")
    def _gspo_is_sequence_level(self) -> LossConfig:
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ValueError("sequence_level_importance_ratios requires token_level_loss=false")
        return self

    @model_validator(mode="after")
    def _truncation_is_consistent(self) -> LossConfig:
        """The checks NeMo RL's ClippedPGLossFn asserts at construction."""
        kind, high, low = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        if (kind is None) != (high is None):
            raise ValueError("set truncated_importance_sampling_type and _ratio together")
        if kind is None:
            return self
        if not self.use_importance_sampling_correction:
            raise ValueError("truncated importance sampling needs use_importance_sampling_correction=true")
        if low is not None and low > high:
            raise ValueError("truncated_importance_sampling_ratio_min must be <= _ratio")
        if kind in ("icepop", "seq-mask-tis") and low is None:
            raise ValueError(f"{kind} needs truncated_importance_sampling_ratio_min")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError("seq-mask-tis is incompatible with sequence_level_importance_ratios")
        return self


class OptimizerConfig(Section):
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)


class TinyModelConfig(Section):
    """Shape of the locally built model used when `policy.model_name` is "tiny"."""

    architecture: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = Field(64, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    intermediate_size: int = Field(128, gt=0)


class VLLMConfig(Section):
    """NeMo RL `policy.generation.vllm_cfg` (the keys the vLLM engine reads)."""

    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    """Fraction of GPU memory vLLM may take; leave room for the weight staging copy."""
    enforce_eager: bool = False
    """Disable CUDA graphs (slower decode, faster start, easier debugging)."""


class GenerationConfig(Section):
    """NeMo RL `policy.generation`."""

    backend: Literal["hf", "vllm"] = "hf"
    max_new_tokens: int = Field(2, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, gt=0)
    stop_strings: list[str] = []
    vllm_cfg: VLLMConfig = VLLMConfig()


class PolicyConfig(Section):
    model_name: str = "tiny"
    """A Hugging Face model id, a local path, or "tiny" for the locally built toy model."""
    tiny: TinyModelConfig = TinyModelConfig()
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    max_total_sequence_length: int = Field(64, gt=0)
    train_micro_batch_size: int = Field(64, gt=0)
    """Samples per forward/backward; gradients accumulate over the step."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    generation: GenerationConfig = GenerationConfig()


class EnvironmentSampling(Section):
    """Sampling for one environment's prompts; 0 or empty = the value in policy.generation."""

    max_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(0.0, ge=0, le=1)
    top_k: int = Field(0, ge=0)
    stop_strings: list[str] = []


class EnvironmentSpec(Section):
    """One environment in the mix; gRPC clients submit the same shape at run time (SubmitEnvironment)."""

    name: str = Field(min_length=1)
    kind: str = ""
    """A built-in environment (math, code, sliding_puzzle, exact_match, toy_copy); empty when `address` is set."""
    address: str = ""
    """host:port of a remote EnvironmentService; empty for built-ins."""
    dataset: str = ""
    """JSONL path in NeMo RL's message format; empty uses the built-in generator of `kind`."""
    weight: float = Field(1.0, ge=0)
    """Mixing weight among environments."""
    max_turns: int = Field(0, ge=0)
    """Most environment turns per episode; 0 = grpo.max_rollout_turns."""
    reward_scale: float = Field(1.0, gt=0)
    """Multiplier on this environment's reward."""
    timeout_s: float = Field(0.0, ge=0)
    """Deadline of one call to a remote environment; 0 = the environment service's default (10 s)."""
    sampling: EnvironmentSampling = EnvironmentSampling()

    @model_validator(mode="after")
    def _kind_xor_address(self) -> EnvironmentSpec:
        if bool(self.kind) == bool(self.address):
            raise ValueError("set exactly one of kind or address")
        return self


class WeightSyncConfig(Section):
    backend: Literal["gloo", "nccl", "nixl", "filesystem"] = "gloo"
    bucket_size_mb: int = Field(256, gt=0)
    """Flat bucket size; tensors larger than a bucket go whole."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline for every collective of a sync; a member that misses it is dropped."""
    store_port: int = Field(0, ge=0, le=65535)
    """TCPStore port on the trainer; 0 picks a free one."""


class ServiceAddresses(Section):
    """Where things listen. The launcher fills in free loopback ports."""

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    controller: str = "127.0.0.1:50051"
    environment: str = "127.0.0.1:50052"
    replay: str = "127.0.0.1:50053"
    rollout: str = "127.0.0.1:50054"
    trainer: str = "127.0.0.1:50055"
    host: str = "127.0.0.1"
    """Host this process advertises to peers (weight-channel rendezvous)."""


class ReplayConfig(Section):
    capacity_groups: int = Field(1024, gt=0)
    """Groups stored before ingest applies back-pressure."""
    selection: Literal["fifo", "freshest"] = "fifo"
    """Which eligible groups a step gets: fifo (ingest order) or freshest (highest version_start first)."""
    fetch_batch: int = Field(64, gt=0, le=4096)
    """Messages pulled from the trajectory stream per fetch (fewer when the buffer is nearly full)."""
    ack_wait_s: float = Field(30.0, gt=0, le=3600)
    """JetStream ack wait: an unacked trajectory is redelivered after this many seconds."""
    tombstone_ttl_s: int = Field(86400, gt=0)
    """Seconds a consumed or evicted group id is remembered, so a late redelivery is not stored again."""


class RolloutConfig(Section):
    num_workers: int = Field(1, gt=0)
    """Rollout processes the local launcher starts."""


class ControllerConfig(Section):
    auth_token: str = Field("", max_length=4096)
    """Bearer token every admin rpc must carry (metadata `authorization: Bearer <token>`); empty disables auth."""


class TelemetryConfig(Section):
    otlp_endpoint: str = ""
    """OTLP gRPC endpoint for traces; empty disables export."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus /metrics port; 0 disables the HTTP server."""
    metrics_host: str = "127.0.0.1"
    """Address /metrics binds to; 0.0.0.0 where Prometheus scrapes from another host or container."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class FlywheelConfig(Section):
    run: RunConfig = RunConfig()
    grpo: GRPOConfig = GRPOConfig()
    loss_fn: LossConfig = LossConfig()
    policy: PolicyConfig = PolicyConfig()
    environments: list[EnvironmentSpec] = [EnvironmentSpec(name="toy", kind="toy_copy")]
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    addresses: ServiceAddresses = ServiceAddresses()
    replay: ReplayConfig = ReplayConfig()
    rollout: RolloutConfig = RolloutConfig()
    controller: ControllerConfig = ControllerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config error: {dotted}: {part} is not a section")
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`grpo.max_staleness=2` -> ("grpo.max_staleness", 2); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"config error: override {text!r} is not key=value")
    return key.strip(), yaml.safe_load(raw)


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    if first["type"] == "extra_forbidden":
        return f"config error: {key}: unknown key"
    return f"config error: {key}: {first['msg']} (got {first.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> FlywheelConfig:
    """YAML file (optional) + dotted overrides -> validated config. Raises ConfigError."""
    tree: dict[str, Any] = {}
    if path:
        text = Path(path).read_text()
        tree = yaml.safe_load(text) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"config error: {path}: top level must be a mapping")
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    try:
        return FlywheelConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None


def dump_config(cfg: FlywheelConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved(cfg: FlywheelConfig, run_dir: str | Path) -> Path:
    """Write the resolved config next to the run, where every service can read it back."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_config(cfg))
    return out

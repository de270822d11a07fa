"""The `teacher:` section of an on-policy distillation run (NeMo RL's distillation_math.yaml `teacher:` and its
`distillation.topk_logits_k`), and the bound on what its scores add to a trajectory group. Imports no torch.

NeMo RL's `teacher:` is a whole copy of the policy's section (`<<: *POLICY_BASE`) with another model_name; only the
keys that mean something to a frozen scorer live here. The teacher shares the student's tokenizer and vocabulary
(as NeMo RL requires), so it has no tokenizer of its own; it scores sequences of at most
policy.max_total_sequence_length tokens, the student's own bound.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from services.common.config_base import Section

NATS_MAX_PAYLOAD = 8 << 20
"""max_payload of every NATS server Flywheel starts (infra.start_nats, deploy/compose/nats.conf,
deploy/slurm/launch.sh): a trajectory group must fit in one message."""
GROUP_HEADROOM = 64 << 10
"""Bytes of a group's message kept for its prompt, text and headers (a generous allowance, not a measurement)."""
BYTES_PER_TOKEN = 16
"""A completion token's own fields on the wire, at most: token id, generated mask, logprob, with their tags."""
BYTES_PER_TOPK = 8
"""One top-k entry: a float32 logit and its token id (a varint of up to 4 bytes for ids below 2**28)."""


class TeacherGeneration(Section):
    """NeMo RL's `teacher.generation:` (distillation_math.yaml copies the policy's whole section into the teacher's):
    of it only the temperature changes the teacher's scores; the other keys are accepted with no effect."""

    temperature: float = Field(1.0, gt=0)
    """Tt: the loss takes the teacher's distribution as softmax(z / Tt) over its top-k logits z, as NeMo RL's
    teacher divides its logits by teacher.generation.temperature before its top-k (apply_temperature_scaling).
    The teacher service sends z unscaled (the same top-k set); the trainer divides (algorithms/distillation.py)."""


class TeacherConfig(Section):
    """The frozen teacher that scores the student's samples (`flywheel serve teacher`, services/rollout/teacher.py)."""

    model_name: str | None = Field(None, min_length=1)
    """A Hugging Face causal LM (id or local path), a `flywheel export` directory, or "tiny" (built locally
    from policy.tiny with `tiny` applied on top and its own `seed`). Required in a distillation run; its
    tokenizer and vocabulary must be the student's (checked before the run starts)."""
    tiny: dict[str, Any] = {}
    """For model_name "tiny": policy.tiny's keys the teacher changes (e.g. {hidden_size: 128, num_hidden_layers:
    4}: a larger teacher). Its vocabulary is the tiny tokenizer's, as the student's."""
    seed: int = 1
    """Initial weights of the tiny teacher (the student's come from run.seed)."""
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the teacher's weights and logits (the logits travel as float32)."""
    topk_logits_k: int = Field(64, gt=0, le=4096)
    """k: the teacher's largest logits kept per position (a distillation run sets it from distillation.topk_logits_k)."""
    num_replicas: int = Field(1, gt=0)
    """Teacher servers a launcher starts when `addresses` is empty (each on its own port and device)."""
    addresses: list[str] = []
    """The teacher servers rollout calls (host:port each), picked least-busy first; empty: the launcher's
    (addresses.teacher with one replica)."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one Score call; a call that misses it is retried (the group waits, it is never published
    unscored)."""
    max_batch_tokens: int = Field(8192, gt=0)
    """Tokens (padded rows x width) in one teacher forward; a request's completions are split to fit."""
    batch_wait_ms: float = Field(2.0, ge=0, le=1000)
    """How long the server waits for other requests to join a forward before it runs it."""
    generation: TeacherGeneration = TeacherGeneration()
    """NeMo RL's key for the teacher's temperature (the one key of the section that means something to a scorer)."""


def group_payload_bytes(k: int, completions: int, max_tokens: int) -> int:
    """Upper bound on a trajectory group's message with the teacher's scores: every completion at its longest,
    each token with its own fields and k top-k entries."""
    return GROUP_HEADROOM + completions * max_tokens * (BYTES_PER_TOKEN + k * BYTES_PER_TOPK)


def payload_problem(k: int, completions: int, max_tokens: int, limit: int = NATS_MAX_PAYLOAD) -> str | None:
    """Why a group with teacher scores may not fit one NATS message, or None."""
    size = group_payload_bytes(k, completions, max_tokens)
    if size <= limit:
        return None
    return (f"a group of {completions} completions of up to {max_tokens} tokens with the teacher's top-{k} logits "
            f"is up to {size / 2**20:.1f} MiB, over NATS' max_payload ({limit / 2**20:.0f} MiB): lower "
            f"teacher.topk_logits_k, policy.max_total_sequence_length or the generations per prompt")

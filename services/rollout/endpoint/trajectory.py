"""An episode's samples, built from the calls the endpoint recorded: pure, no IO.

A call is a prompt (token ids, exactly as the engine saw them) and its choices (the sampled token ids, their
logprobs and policy versions). The calls are added in the order they finished:

    prompt extends a sample   (sample.token_ids == prompt[:len(sample)], the longest such sample)
        -> that sample grows: prompt[len(sample):] masked (tool results, the template's turn markers),
           then the choice's tokens trainable (generated_mask True, logprobs and versions kept)
    prompt extends no sample  -> a new sample: the prompt masked, then the choice's tokens trainable;
                                 `add` returns False (the endpoint counts it) unless nothing was recorded yet
    n > 1 choices             -> every choice grows its own copy of the extended sample (the first takes
                                 its place)

So the trainer trains on exactly the ids the engine sampled, never on a re-tokenization of them, and a call
whose history was rewritten (an agent that re-templates or edits past turns) never lines up tokens of one
rendering with logprobs of another: it starts a sample of its own, where the earlier turns are context.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class Choice:
    """One sampled continuation of a call's prompt."""

    token_ids: list[int]
    """Generated tokens, a stop token included when sampled; [n]."""
    logprobs: list[float]
    """The engine's log softmax(logits / T) of each token; [n]."""
    versions: list[int]
    """Policy version that sampled each token; [n]."""
    truncated: bool = False
    """Stopped by max_tokens (or the sequence limit) rather than a stop."""
    flaws: int = 0
    """TurnFlaw bits the endpoint found in this reply (services/rollout/flaws.py); every one of its tokens carries them."""


@dataclass(kw_only=True, slots=True)
class Call:
    prompt_ids: list[int]
    """The prompt exactly as the engine saw it; [p]."""
    choices: list[Choice]


@dataclass(kw_only=True, slots=True)
class Sample:
    """One training row: the whole token sequence from its first token, with the loss mask."""

    token_ids: list[int] = field(default_factory=list)
    generated_mask: list[bool] = field(default_factory=list)
    """Per token: True where the policy sampled it (trained); False for prompts, tool results, template
    tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Per token: the engine's logprob where generated, 0.0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """Per token: the policy version that sampled it, -1 where not generated."""
    flaws: list[int] = field(default_factory=list)
    """Per token: the TurnFlaw bits of the reply that generated it, 0 where not generated."""
    calls: int = 0
    """Calls whose choice this sample ends with or passes through."""
    truncated: bool = False
    """Some choice in it stopped at its token budget."""

    def copy(self) -> Sample:
        return Sample(token_ids=list(self.token_ids), generated_mask=list(self.generated_mask),
                      logprobs=list(self.logprobs), versions=list(self.versions), flaws=list(self.flaws),
                      calls=self.calls, truncated=self.truncated)

    def extend(self, tokens: list[int], choice: Choice | None) -> None:
        """Append `tokens` masked (context), or the choice's tokens trainable when `choice` is given."""
        if choice is None:
            self.token_ids += tokens
            self.generated_mask += [False] * len(tokens)
            self.logprobs += [0.0] * len(tokens)
            self.versions += [-1] * len(tokens)
            self.flaws += [0] * len(tokens)
            return
        self.token_ids += choice.token_ids
        self.generated_mask += [True] * len(choice.token_ids)
        self.logprobs += choice.logprobs
        self.versions += choice.versions
        self.flaws += [choice.flaws] * len(choice.token_ids)
        self.calls += 1
        self.truncated |= choice.truncated

    @property
    def version_start(self) -> int:
        return min((v for v in self.versions if v >= 0), default=-1)

    @property
    def version_end(self) -> int:
        return max(self.versions, default=-1)


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """What an episode leaves for training: its samples in the order they were started."""

    samples: list[Sample] = field(default_factory=list)
    calls: int = 0
    new_samples: int = 0
    """Calls that extended no recorded sample although one existed (each started a sample)."""
    conversation: list[dict] = field(default_factory=list)
    """The latest chat call's messages and its first choice's reply, as the chat template took them (tool-call
    arguments as objects); empty when the episode made no chat call. Eval and collect show the episode by it."""


class TrajectoryBuilder:
    """Grows an episode's samples call by call (see the module docstring for the rule)."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()

    def add(self, call: Call) -> bool:
        """Record `call`; False when its prompt extends no sample although samples exist."""
        if not call.choices:
            raise ValueError("a call has at least one choice")
        samples = self.trajectory.samples
        parent = self.extended(call.prompt_ids)
        extends = parent is not None or not samples
        base = samples[parent] if parent is not None else Sample()
        grown = [base.copy() for _ in call.choices]
        for sample, choice in zip(grown, call.choices):
            sample.extend(call.prompt_ids[len(base.token_ids):], None)
            sample.extend([], choice)
        if parent is not None:
            samples[parent] = grown.pop(0)
        samples += grown
        self.trajectory.calls += 1
        self.trajectory.new_samples += not extends
        return extends

    def extended(self, prompt: list[int]) -> int | None:
        """Index of the longest sample that `prompt` starts with (the first of equals); None if none does."""
        best = None
        for i, sample in enumerate(self.trajectory.samples):
            n = len(sample.token_ids)
            if n <= len(prompt) and prompt[:n] == sample.token_ids:
                if best is None or n > len(self.trajectory.samples[best].token_ids):
                    best = i
        return best


def group_rows(samples: list[Sample]) -> tuple[list[int], list[dict]]:
    """Samples (of one episode or of a prompt group's episodes) in a TrajectoryGroup's shape: the longest prefix
    that every sample shares and none generated (`prompt_token_ids`), and per sample the fields of a Completion
    (`token_ids` after that prefix, `generated_mask`, `generation_logprobs`, `version_start`, `version_end`,
    `truncated`, and `flaws` where some turn had one). Samples that share nothing give an empty prompt. An empty
    sample (an episode that never called the model) leaves the prefix to the others and gives an empty completion:
    were it counted, the prompt would be empty and its row hold no token at all, which the trainer cannot take."""
    if not samples:
        return [], []
    called = [s for s in samples if s.token_ids] or samples
    first = called[0]
    n = min(len(s.token_ids) for s in called)
    shared = next((i for i in range(n) if first.generated_mask[i]
                   or any(s.token_ids[i] != first.token_ids[i] for s in called)), n)
    rows = [{"token_ids": s.token_ids[shared:], "generated_mask": s.generated_mask[shared:],
             "generation_logprobs": s.logprobs[shared:], "version_start": s.version_start,
             "version_end": s.version_end, "truncated": s.truncated,
             "flaws": s.flaws[shared:] if any(s.flaws) else []} for s in samples]
    return first.token_ids[:shared], rows

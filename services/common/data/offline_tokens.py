"""Offline examples -> the TrajectoryGroups GRPO's path carries, and which examples each step trains on (pure).

    SFTExample        -> one group, one completion: the conversation's tokens, generated_mask = assistant turns
    PreferenceExample -> one group, two completions: chosen then rejected after the shared context tokens

Tokens follow NeMo RL's get_formatted_message_log: the chat template (tools included) is applied to
each growing prefix of the conversation and each message takes the text its turn adds, tokenized on
its own; an assistant message's tokens (its role header included) carry the loss, the tokenizer's BOS
starts the conversation when the template gave none (add_bos) and its EOS ends the last message (add_eos). So the trainer's batch.py builds the same rows as for a rollout:
prompt tokens untrained, completion tokens trained where the mask says.

Step t trains on examples order[t*P:(t+1)*P] of its epoch (P = grpo.num_prompts_per_step, the last
partial batch of an epoch dropped as NeMo RL's dataloaders do), each epoch shuffled by run.seed when
data.shuffle is on. The controller publishes them and the trainer counts the steps with the same
functions, so both agree on where the run ends. Imports no torch.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from services.common.pb.flywheel.v1 import types_pb2
from services.common.data.offline import Dropped, PreferenceExample, SFTExample, over_limit
from services.common.data.offline_load import Drop, load_offline


@dataclass(kw_only=True, slots=True)
class Tokenized:
    """One example as token pieces: (ids, trained) per message, the context's apart from each completion's."""

    context: list[tuple[list[int], bool]]
    completions: list[list[tuple[list[int], bool]]]
    where: str = ""


@dataclass(kw_only=True, slots=True)
class OfflinePlan:
    examples: list[Tokenized]
    steps: int
    """Steps the data gives: min(max_num_steps, epochs * (len(examples) // P))."""
    per_step: int
    seed: int
    shuffle: bool
    drops: list[Drop] = field(default_factory=list)
    """Examples over the sequence limit or the template cannot render incrementally."""

    def rows(self, step: int) -> list[Tokenized]:
        """The examples of `step`, in order."""
        per_epoch = len(self.examples) // self.per_step
        epoch, batch = divmod(step, per_epoch)
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
        return [self.examples[i] for i in order[batch * self.per_step:(batch + 1) * self.per_step]]


def message_pieces(tokenizer, messages: list[dict], tools: list[dict] | None, start: int = 0, *, eos: bool = True
                   ) -> list[tuple[list[int], bool]]:
    """Token ids of messages[start:], each as the text its turn adds to the rendered prefix before it."""
    pieces, prev = [], _render(tokenizer, messages[:start], tools) if start else ""
    for i in range(start, len(messages)):
        text = _render(tokenizer, messages[:i + 1], tools)
        if not text.startswith(prev):
            raise Dropped("the chat template does not render the conversation incrementally (a prefix changes "
                          "when a turn is added), so the assistant turns cannot be masked")
        ids = tokenizer(text[len(prev):], add_special_tokens=False)["input_ids"]
        pieces.append((list(ids), messages[i]["role"] == "assistant"))
        prev = text
    bos, eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id if eos else None
    if pieces and start == 0 and bos is not None and pieces[0][0][:1] != [bos]:  # NeMo RL's add_bos
        pieces[0][0].insert(0, bos)
    if pieces and messages[-1]["role"] == "assistant" and eos_id is not None and pieces[-1][0][-1:] != [eos_id]:
        pieces[-1][0].append(eos_id)  # add_eos
    return pieces


def _render(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)


def tokenize_sft(tokenizer, ex: SFTExample) -> Tokenized:
    """Context: the messages before the first assistant one; one completion: the rest."""
    first = next(i for i, m in enumerate(ex.messages) if m["role"] == "assistant")
    pieces = message_pieces(tokenizer, ex.messages, ex.tools)
    return Tokenized(context=pieces[:first], completions=[pieces[first:]], where=ex.where)


def tokenize_pair(tokenizer, ex: PreferenceExample, *, eos: bool = True) -> Tokenized:
    """eos False (rm): the scored sequence ends as `flywheel serve reward_model` renders a conversation, so the
    head learns the score at the token it is read at."""
    context = message_pieces(tokenizer, ex.context, ex.tools)
    sides = [message_pieces(tokenizer, ex.context + side, ex.tools, start=len(ex.context), eos=eos)
             for side in (ex.chosen, ex.rejected)]
    return Tokenized(context=context, completions=sides, where=ex.where)


def length(t: Tokenized, side: int) -> int:
    return sum(len(ids) for ids, _ in t.context) + sum(len(ids) for ids, _ in t.completions[side])


def build_plan(tokenizer, examples: list, *, kind: str, max_seq_length: int, per_step: int, max_num_steps: int,
               epochs: int, seed: int, shuffle: bool, eos: bool = True) -> OfflinePlan:
    """Tokenize every example (dropping, with its reason, one over the limit) and size the run."""
    kept, drops = [], []
    for ex in examples:
        try:
            t = tokenize_sft(tokenizer, ex) if kind == "sft" else tokenize_pair(tokenizer, ex, eos=eos)
            reason = over_limit(kind, tuple(length(t, s) for s in range(len(t.completions))), max_seq_length)
            if reason:
                raise Dropped(f"over the sequence limit ({reason})")
        except Dropped as err:
            drops.append(Drop(where=ex.where, reason=str(err)))
            continue
        kept.append(t)
    if len(kept) < per_step:
        raise ValueError(f"data.train: {len(kept)} usable examples, fewer than one step's "
                         f"{per_step} (policy.train_global_batch_size)")
    steps = min(max_num_steps, epochs * (len(kept) // per_step))
    return OfflinePlan(examples=kept, steps=steps, per_step=per_step, seed=seed, shuffle=shuffle, drops=drops)


def group_of(t: Tokenized, *, group_id: str, step: int, env_name: str, now_ns: int) -> types_pb2.TrajectoryGroup:
    """The example as a TrajectoryGroup for `step`: version_start = step, so replay serves it to that step and
    no earlier one (it serves groups whose version_start <= the step, oldest ingested first)."""
    group = types_pb2.TrajectoryGroup(group_id=group_id, prompt_id=t.where, env_name=env_name, target_step=step,
                                      prompt_token_ids=[i for ids, _ in t.context for i in ids],
                                      version_start=step, leased_at_unix_ns=now_ns, finished_at_unix_ns=now_ns)
    for rank, pieces in enumerate(t.completions):
        ids = [i for piece, _ in pieces for i in piece]
        mask = [trained for piece, trained in pieces for _ in piece]
        group.completions.append(types_pb2.Completion(
            token_ids=ids, generated_mask=mask, generation_logprobs=[0.0] * len(ids), version_start=step,
            version_end=step, reward=1.0 if rank == 0 else 0.0))  # preference pairs: chosen 1, rejected 0
    return group


def group_id(run: str, seed: int, step: int, index: int) -> str:
    """The same for the same run, step and place, so a restarted controller's publish is deduplicated."""
    return hashlib.sha256(f"{run}/{seed}/offline/{step}/{index}".encode()).hexdigest()[:32]


def load_plan(cfg, tokenizer) -> tuple[OfflinePlan, list[Tokenized], list[str]]:
    """data.train as the run's plan, data.validation tokenized, and the lines that report kept and dropped rows.
    cfg: a FlywheelConfig whose algorithm is sft, dpo or rm."""
    kind = "sft" if cfg.algorithm == "sft" else "preference"
    loaded = load_offline(cfg, kind)
    lines = [*loaded.notes, *(line for s in (*loaded.train, *loaded.validation) for line in s.lines())]
    g = cfg.grpo
    plan = build_plan(tokenizer, [ex for s in loaded.train for ex in s.examples], kind=kind,
                      max_seq_length=cfg.policy.max_total_sequence_length, per_step=g.num_prompts_per_step,
                      max_num_steps=g.max_num_steps, epochs=g.max_num_epochs, seed=cfg.run.seed,
                      shuffle=cfg.data.shuffle, eos=cfg.algorithm != "rm")
    validation = build_plan(tokenizer, [ex for s in loaded.validation for ex in s.examples], kind=kind,
                            max_seq_length=cfg.policy.max_total_sequence_length, per_step=1, max_num_steps=1,
                            epochs=1, seed=cfg.run.seed, shuffle=False, eos=cfg.algorithm != "rm"
                            ) if loaded.validation else None
    lines += [f"data: {d.where}: dropped: {d.reason}" for d in plan.drops + (validation.drops if validation else [])]
    return plan, validation.examples if validation else [], lines


def offline_plan_config(cfg):
    """What `flywheel up` prints and bounds before anything starts, as plan_config does for GRPO: the data read
    and tokenized (every drop named), grpo.max_num_steps set to the steps the data gives."""
    from services.common.tokenizing import load_tokenizer_without_torch

    plan, validation, lines = load_plan(cfg, load_tokenizer_without_torch(cfg.policy))
    if plan.steps < cfg.grpo.max_num_steps:
        lines.append(f"{cfg.algorithm}.max_num_steps {cfg.grpo.max_num_steps} -> {plan.steps}: max_num_epochs="
                     f"{cfg.grpo.max_num_epochs} over {len(plan.examples)} examples, {plan.per_step} per step")
    cfg = cfg.model_copy(deep=True)
    cfg.grpo.max_num_steps = cfg.offline.max_num_steps = plan.steps  # both: validating again copies one to the other
    return cfg, lines

"""`flywheel data from-gym`: NeMo Gym rollouts -> an SFT or a DPO dataset that data.train reads.

    rollouts.jsonl ──(a rollout a line)──▶ Rollout(prompt, episode, tools, reward) ──▶ sft: reward >= R
                                                                                 └──▶ dpo: per prompt, best vs
                                                                                      worst, their gap >= G

A line of rollouts.jsonl is what NeMo Gym's `ng_collect_rollouts` / `gym eval run` writes for one
rollout (nemo_gym/rollout_collection.py): `responses_create_params` (input, instructions, tools),
`response` (a Responses API object; its `output` items are the episode: messages, reasoning,
function_call, function_call_output), `reward`, and the verifier's extra fields. A top-level `output`
list is read when there is no `response` (NeMo Gym's training docs show that shape). Items become
chat messages as NeMo Gym's converter makes them (responses.py).

SFT rows: {"messages": prompt + episode, "tools": [...]} (NeMo RL's openai_format). DPO rows: NeMo RL's
PreferenceDataset {"context", "completions": [{"rank": 0, ...}, {"rank": 1, ...}], "tools"}, so tool calls
and multi-turn episodes survive (BinaryPreferenceDataset holds one text answer a side). Rollouts are of
the same prompt when their prompt messages and tools are equal. Every row is checked by the loader that
will read it (offline.py), so what is written loads back; every rollout left out is named with its reason.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from services.common.jsonl import write_jsonl
from services.common.data.offline import Dropped, OfflineKeys, preference_example, sft_example
from services.common.data.offline_load import Drop, reason_kind
from services.common.data.responses import chat_from_items, chat_tools, prompt_messages
from services.common.data.rows import RowError, Templates
from services.common.data.sources import SourceError, decode_utf8


class GymDataError(ValueError):
    """A rollouts file that gives no dataset at all; the message says why."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Rollout:
    where: str
    """file:line of the rollout."""
    reward: float
    prompt: list[dict]
    """responses_create_params as chat messages."""
    episode: list[dict]
    """The response's output items as chat messages."""
    tools: list[dict] | None


def read_rollouts(path: Path) -> tuple[list[Rollout], list[Drop]]:
    """Every line of a rollouts.jsonl; a line that is not a usable rollout is a Drop, never an error."""
    rollouts, drops = [], []
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as err:
        raise GymDataError(f"{path}: {err.strerror or err}") from None
    for n, raw in enumerate(raw_lines, 1):
        where = f"{path}:{n}"
        if not raw.strip():
            continue
        try:
            rollouts.append(_rollout(json.loads(decode_utf8(raw, where)), where))
        except (Dropped, RowError) as why:
            drops.append(Drop(where=where, reason=str(why)))
        except (json.JSONDecodeError, SourceError) as err:
            drops.append(Drop(where=where, reason=f"not a JSON line ({getattr(err, 'msg', err)})"))
    if not rollouts and not drops:
        raise GymDataError(f"{path}: no rollouts (the file is empty)")
    return rollouts, drops


def _rollout(record: object, where: str) -> Rollout:
    if not isinstance(record, dict):
        raise Dropped("not a JSON object")
    reward = record.get("reward")
    if reward is None:
        raise Dropped("no reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise Dropped(f"a reward that is not a finite number ({reward!r})")
    response = record.get("response")
    items = response.get("output") if isinstance(response, dict) else record.get("output")
    if items is None:
        raise Dropped("no output items (neither response.output nor output)")
    params = record.get("responses_create_params")
    return Rollout(where=where, reward=float(reward), prompt=prompt_messages(params),
                   episode=chat_from_items(items, "response.output"), tools=chat_tools(params))


def sft_rows(rollouts: list[Rollout], min_reward: float) -> tuple[list[dict], list[Drop]]:
    """A row per rollout at or above `min_reward` that the SFT loader accepts."""
    rows, drops = [], []
    for r in rollouts:
        if r.reward < min_reward:
            drops.append(Drop(where=r.where, reason=f"reward below --min-reward {min_reward:g} ({r.reward:g})"))
            continue
        try:
            ex = sft_example({"messages": r.prompt + r.episode, "tools": r.tools}, OfflineKeys(), Templates(), r.where)
        except (Dropped, RowError) as why:
            drops.append(Drop(where=r.where, reason=str(why)))
            continue
        rows.append({"messages": ex.messages, **({"tools": ex.tools} if ex.tools else {}), "reward": r.reward,
                     "source": r.where})
    return rows, drops


def dpo_rows(rollouts: list[Rollout], min_gap: float) -> tuple[list[dict], list[Drop], int]:
    """(a pair per prompt: its best rollout chosen, its worst rejected, when their rewards differ by at least
    `min_gap`; drops; rollouts of paired prompts left between best and worst)."""
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(json.dumps([r.prompt, r.tools], sort_keys=True), []).append(r)
    rows, drops, between = [], [], 0
    for group in groups.values():
        where = ", ".join(r.where for r in group)
        best = max(group, key=lambda r: r.reward)  # the first of equals, in file order
        worst = min(group, key=lambda r: r.reward)
        if len(group) < 2:
            drops.append(Drop(where=where, reason="the only rollout of its prompt"))
        elif (gap := best.reward - worst.reward) < min_gap:
            drops.append(Drop(where=where, reason=f"reward gap below --min-gap {min_gap:g} ({gap:g}, {len(group)} "
                                                  "rollouts of one prompt)"))
        else:
            try:
                rows.append(_pair(best, worst))
                between += len(group) - 2
            except (Dropped, RowError) as why:
                drops.append(Drop(where=f"{best.where} vs {worst.where}", reason=str(why)))
    return rows, drops, between


def _pair(best: Rollout, worst: Rollout) -> dict:
    row = {"context": best.prompt, "completions": [{"rank": 0, "completion": best.episode},
                                                   {"rank": 1, "completion": worst.episode}], "tools": best.tools}
    ex = preference_example(row, OfflineKeys(), Templates(), best.where)
    return {"context": ex.context, "completions": [{"rank": 0, "completion": ex.chosen},
                                                   {"rank": 1, "completion": ex.rejected}],
            **({"tools": ex.tools} if ex.tools else {}), "reward_chosen": best.reward, "reward_rejected": worst.reward,
            "source": f"{best.where} vs {worst.where}"}


def convert(path: Path, to: str, out: Path, *, min_reward: float, min_gap: float) -> list[str]:
    """Reads, selects, writes `out`; the lines to print. GymDataError when nothing is kept."""
    if out.suffix != ".jsonl":
        raise GymDataError(f"--out {out}: must end in .jsonl (data.train reads a dataset by its suffix)")
    rollouts, drops = read_rollouts(path)
    between = 0
    if to == "sft":
        rows, selected = sft_rows(rollouts, min_reward)
    else:
        rows, selected, between = dpo_rows(rollouts, min_gap)
    lines = [f"from-gym: {d.where}: dropped: {d.reason}" for d in drops + selected]
    read = f"from-gym: {path}: rollouts read: {len(rollouts)}, lines unusable: {len(drops)}"
    if not rows:
        raise GymDataError("\n".join([*lines, f"{read}; no {to.upper()} row kept, nothing written"]))
    write_jsonl(out, rows)
    counts = Counter(reason_kind(d.reason) for d in drops + selected)
    tail = f"; rollouts between a pair's best and worst, not used: {between}" if between else ""
    kept = f"{'SFT rows' if to == 'sft' else 'DPO pairs'}: {len(rows)}"
    return [*lines, f"{read}; {kept}, written to {out}; dropped: "
                    f"{', '.join(f'{n} {r}' for r, n in counts.items()) or 'none'}{tail}"]


def from_gym_command(args) -> int:
    try:
        lines = convert(Path(args.rollouts), args.to, Path(args.out), min_reward=args.min_reward, min_gap=args.min_gap)
    except GymDataError as err:
        print(err, flush=True)
        return 2
    print("\n".join(lines), flush=True)
    return 0

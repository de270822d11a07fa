"""A briefly supervised start for the tool_add task: the tiny model trained on demonstrations, saved as a model dir.

A random tiny model never writes a 70-character <tool_call> block by chance, so RL alone gets no signal. The
demonstrations are the episodes the rollout itself would record for a right answer: the prompt as the chat template
renders it with the tool, the call the template writes (which vLLM's hermes parser reads back) and EOS, the tool's
result as `observation_text` writes it, and the sum and EOS. Cross-entropy on the assistant tokens only. Each call
is trained on; each final answer only with probability `answer_fraction`, so the run starts with room to learn.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from services.common.config import load_config
from services.common.modeling import build_tiny_model, build_tiny_tokenizer
from services.environment.envs.tool_add import ADD_TOOL, OPERANDS
from services.rollout.episodes import prompt_token_ids
from services.rollout.tools import observation_text, render


def demonstration(tok, a: int, b: int, *, train_answer: bool) -> tuple[list[int], list[bool]]:
    """(token ids, trained mask) of one right tool_add episode."""
    return tool_episode(tok, f"add {a} {b}", ADD_TOOL, {"a": a, "b": b}, str(a + b), train_answer=train_answer)


def tool_episode(tok, prompt_text: str, tool: dict, arguments: dict, result: str, *,
                 train_answer: bool = True) -> tuple[list[int], list[bool]]:
    """(token ids, trained mask) of an episode that calls `tool` with `arguments`, is given `result`, and answers
    with the result: the call as the chat template writes it (which vLLM's hermes parser reads back) and EOS, the
    tool message as the template renders it, the answer and EOS."""
    prompt = [{"role": "user", "content": prompt_text}]
    name = tool["function"]["name"]
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    turn = prompt + [{"role": "assistant", "content": "", "tool_calls": [call]}]
    call_text = render(tok, turn, [tool], add_generation_prompt=False)[len(
        render(tok, prompt, [tool], add_generation_prompt=True)):].rstrip("\n")
    observation = [{"role": "tool", "content": result, "tool_call_id": "call_0", "name": name}]
    return _pieces([(prompt_token_ids(tok, prompt, [tool]), False),
                    (_ids(tok, call_text) + [tok.eos_token_id], True),
                    (_ids(tok, observation_text(tok, turn, observation, [tool])), False),
                    (_ids(tok, result) + [tok.eos_token_id], train_answer)])


def direct_answer(tok, prompt_text: str, tool: dict, answer: str) -> tuple[list[int], list[bool]]:
    """(token ids, trained mask) of an episode that answers `answer` at once, without calling the offered tool."""
    prompt = [{"role": "user", "content": prompt_text}]
    return _pieces([(prompt_token_ids(tok, prompt, [tool]), False), (_ids(tok, answer) + [tok.eos_token_id], True)])


def _pieces(pieces: list[tuple[list[int], bool]]) -> tuple[list[int], list[bool]]:
    ids = [t for piece, _ in pieces for t in piece]
    mask = [m for piece, m in pieces for _ in piece]
    return ids, mask


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


THINK, END_THINK = "<think>", "</think>"
"""A thinking model's tags: Qwen3's and DeepSeek-R1's, tokens of their vocabularies (not special)."""


def thinking_model(out: Path, steps: int = 120) -> Path:
    """The tiny model, its tokenizer given the thinking tags, taught to answer "add a b" as `<think>a+b</think>`
    and the sum: a thinking model for vLLM's deepseek_r1 reasoning parser."""
    def demo(tok, rng: random.Random) -> tuple[list[int], list[bool]]:
        a, b = rng.randrange(5), rng.randrange(5)
        prompt = prompt_token_ids(tok, [{"role": "user", "content": f"add {a} {b}"}], None)
        reply = _ids(tok, f"{THINK}{a}+{b}{END_THINK}{a + b}") + [tok.eos_token_id]
        return prompt + reply, [False] * len(prompt) + [True] * len(reply)

    return supervise(out, demo, steps=steps, threads=1, added_tokens=[THINK, END_THINK])


def thinking_config(model_dir: Path, max_total_sequence_length: int):
    """The config that serves `thinking_model`'s model on the hf engine with vLLM's deepseek_r1 reasoning parser."""
    return load_config(None, ["policy.generation.backend=hf", f"policy.model_name={model_dir}",
                              f"policy.max_total_sequence_length={max_total_sequence_length}",
                              "policy.generation.max_new_tokens=16", "policy.generation.reasoning_parser=deepseek_r1"])


def warm_start(out: Path, *, steps: int, answer_fraction: float, pairs: list[tuple[int, int]] | None = None,
               seed: int = 0, batch: int = 16, threads: int | None = None) -> Path:
    """Train the tiny model `steps` AdamW steps on tool_add demonstrations of `pairs` (default: every pair of
    operands); save it with its tokenizer to `out`, as a directory policy.model_name can name."""
    pairs = pairs or [(a, b) for a in range(OPERANDS) for b in range(OPERANDS)]

    def demo(tok, rng: random.Random) -> tuple[list[int], list[bool]]:
        return demonstration(tok, *rng.choice(pairs), train_answer=rng.random() < answer_fraction)

    return supervise(out, demo, steps=steps, seed=seed, batch=batch, threads=threads)


def supervise(out: Path, demo, *, steps: int, seed: int = 0, batch: int = 16, overrides: list[str] = (),
              threads: int | None = None, added_tokens: list[str] = ()) -> Path:
    """Train the tiny model (policy config with `overrides`) `steps` AdamW steps on batches of `demo(tok, rng)`
    (token ids, trained mask); cross-entropy on the trained tokens only. Saved with its tokenizer to `out`.
    `threads`: torch's for the training (a model this small trains several times faster on one thread than on
    two cores other processes are using). `added_tokens`: added to the tiny tokenizer first, not special (as a
    thinking model's tags are: decoded with the text, and looked up as tokens by vLLM's reasoning parsers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _supervise(out, demo, steps=steps, seed=seed, batch=batch, overrides=overrides,
                          added_tokens=added_tokens)
    finally:
        torch.set_num_threads(before)


def _supervise(out: Path, demo, *, steps: int, seed: int, batch: int, overrides: list[str],
               added_tokens: list[str]) -> Path:
    cfg = load_config(None, list(overrides))
    tok = build_tiny_tokenizer()
    tok.add_tokens(list(added_tokens))
    model = build_tiny_model(cfg.policy, len(tok), seed).train()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        rows = [demo(tok, rng) for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r, _ in rows])
        mask = torch.tensor([m + [False] * (width - len(m)) for _, m in rows])[:, 1:]
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
        optim.zero_grad()
        loss.backward()
        optim.step()
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out

"""The Hugging Face transformers backend (`policy.generation.backend: hf`): for machines without vLLM.

Calls run one padded batch at a time on the engine's one thread, where weight loads take their turn, so a
load always happens between batches and every token of a call carries the version loaded during the call.
Calls that wait while a batch runs are merged into the next batch when they sample alike (same settings,
no seed, and the wider padding leaves every row its full max_new_tokens): a rollout worker's groups in
flight then cost one `generate` instead of one each, as a continuous-batching engine would. A batch cannot
take calls that arrive once it runs, so before the next one the engine waits, for at most FILL_WAIT of the
last batch's time, until as many calls wait as were active during the last batch (they, or the groups
that replace them, call again): otherwise a call that arrived early runs alone, the rest in a second batch,
and a small model's batch costs nearly as much for one group as for all of them.
The weight receiver runs in this process and fills the model's own parameters in place.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from services.common.config import FlywheelConfig
from services.common.modeling import load_policy, token_logprobs
from services.common.server import SerialThread
from services.rollout.engines import Engine, Generated, Sampling


class HFEngine(Engine):
    """transformers `generate` on CPU or one GPU; for tests, the local run and small models."""

    def __init__(self, cfg: FlywheelConfig, worker_id: str, device: str = "cpu") -> None:
        from services.common.weights import WeightReceiver

        if cfg.grpo.async_grpo.in_flight_weight_updates:
            raise ValueError("grpo.async_grpo.in_flight_weight_updates needs policy.generation.backend=vllm")
        self.model, self.tokenizer = load_policy(cfg.policy, cfg.run.seed, device)
        self.device = device
        self.max_len = cfg.policy.max_total_sequence_length
        self.receiver = WeightReceiver(worker_id, cfg.weight_sync.backend, host=cfg.addresses.host)
        self.buffers = {name: t.data for name, t in self.model.state_dict(keep_vars=True).items()}
        self.version = -1
        self.thread = SerialThread("hf-engine")  # batches and weight loads take turns on it
        self._waiting: list[tuple[list[list[int]], Sampling, asyncio.Future]] = []
        self._arrived = asyncio.Event()  # set by each call that starts waiting
        self._runner: asyncio.Task | None = None
        self._active = 0  # calls answered by the last batch plus those that waited meanwhile
        self._batch_s = 0.0  # how long the last batch took
        self.running_rows = 0
        """Rows of the batch handed to the engine's thread and not returned yet (0 between batches)."""

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((prompts, sampling, future))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run_waiting())
        return await future

    async def _run_waiting(self) -> None:
        """Run the waiting calls, one batch at a time, merging those that can share a batch."""
        while self._waiting:
            await self._fill()
            batch = self._take_batch()
            t0 = time.perf_counter()
            rows = [p for ps, _, _ in batch for p in ps]
            self.running_rows = len(rows)
            try:
                outs = await self.thread.call(self._generate, rows, batch[0][1])
            except BaseException as err:  # noqa: BLE001 - every caller of the batch gets it
                for *_, future in batch:
                    if future.done():
                        continue
                    if isinstance(err, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(err)
                if isinstance(err, asyncio.CancelledError):
                    raise
                continue
            finally:
                self.running_rows = 0
            self._batch_s, self._active = time.perf_counter() - t0, len(batch) + len(self._waiting)
            start = 0
            for prompts, _, future in batch:
                if not future.done():  # a caller that stopped waiting (cancelled) loses nothing by this
                    future.set_result(outs[start:start + len(prompts)])
                start += len(prompts)

    async def _fill(self) -> None:
        """Wait until as many calls wait as were active during the last batch, or FILL_WAIT of its time."""
        deadline = time.perf_counter() + FILL_WAIT * self._batch_s
        while len(self._waiting) < self._active and (left := deadline - time.perf_counter()) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _take_batch(self) -> list[tuple[list[list[int]], Sampling, asyncio.Future]]:
        """The oldest waiting call and every later one that samples alike and keeps its full budget."""
        first = self._waiting.pop(0)
        batch, rest = [first], []
        width, rows = max(map(len, first[0]), default=0), len(first[0])
        key = _merge_key(first[1])
        for call in self._waiting:
            w = max(width, max(map(len, call[0]), default=0))
            if (key is not None and _merge_key(call[1]) == key and self.max_len - w >= call[1].max_new_tokens
                    and rows + len(call[0]) <= MAX_MERGED_ROWS):
                batch.append(call)
                width, rows = w, rows + len(call[0])
            else:
                rest.append(call)
        self._waiting = rest
        return batch

    async def load_weights(self, announcement: dict[str, Any], timeout_s: float) -> str:
        return await self.thread.call(self._load, announcement, timeout_s)

    async def close(self) -> None:
        self.thread.close()
        self.receiver.close()

    def _load(self, announcement: dict[str, Any], timeout_s: float) -> str:
        digest = self.receiver.receive(announcement, self.buffers, timeout_s=timeout_s)
        self.version = int(announcement["version"])
        return digest

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Generated]:
        tok = self.tokenizer
        width = max(map(len, prompts))
        budget = max(0, min(sampling.max_new_tokens, self.max_len - width))
        if budget == 0:
            return [Generated(token_ids=[], logprobs=[], text="", truncated=True) for _ in prompts]
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues from the right edge
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        first = _FirstToken()
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=True,
            logits_processor=[first],
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0,
            max_new_tokens=budget, eos_token_id=self._stop_ids(sampling), pad_token_id=tok.pad_token_id,
            stop_strings=sampling.stop_strings or None, tokenizer=tok if sampling.stop_strings else None,
            return_dict_in_generate=True, output_logits=True)
        version = self.version  # no load runs meanwhile: loads take their turn on this thread
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).cpu()  # raw logits: the trainer's definition after / T
        logp = token_logprobs(logits, new, sampling.temperature)
        rows = [self._trim(new[i], logp[i], sampling, budget) for i in range(len(prompts))]
        for row in rows:  # one batch: every row's first token comes out of the same forward pass
            row.first_token_s = first.seconds
            row.versions = [version] * len(row.token_ids)
        return rows

    def _stop_ids(self, sampling: Sampling) -> list[int]:
        return [self.tokenizer.eos_token_id, *sampling.stop_token_ids]

    def _trim(self, tokens: torch.Tensor, logp: torch.Tensor, sampling: Sampling, budget: int) -> Generated:
        """Cut after EOS or a stop token (kept), or at the end of the first stop string (kept, as vLLM does)."""
        ids = tokens.tolist()
        stops = set(self._stop_ids(sampling))
        n = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))  # HF pads after a stop
        text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
        stopped = n > 0 and ids[n - 1] in stops
        for stop in sampling.stop_strings:
            if stop in text:
                stopped = True
                text = text[: text.index(stop) + len(stop)]
                n = self._tokens_covering(ids, n, text)
                break
        return Generated(token_ids=ids[:n], logprobs=logp[:n].tolist(), text=text,
                         truncated=not stopped and n >= budget)

    def _tokens_covering(self, ids: list[int], n: int, text: str) -> int:
        for k in range(1, n + 1):
            if len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(text):
                return k
        return n


MAX_MERGED_ROWS = 256
"""Rows one merged batch may hold at most (a single larger call still runs, alone)."""
FILL_WAIT = 0.25
"""Longest wait for the calls of the last batch to come back, as a fraction of that batch's time: the most
the engine idles when they do not (the last groups of a run, episodes that ended)."""


def _merge_key(sampling: Sampling) -> tuple | None:
    """Calls with equal keys may share a batch; None (a seeded call: its rows depend on the batch) never does."""
    if sampling.seed is not None:
        return None
    return (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
            tuple(sampling.stop_strings), tuple(sampling.stop_token_ids))


class _FirstToken:
    """A pass-through logits processor that notes when the first token's logits exist (after prefill)."""

    def __init__(self) -> None:
        self.t0, self.seconds = time.perf_counter(), None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.t0
        return scores

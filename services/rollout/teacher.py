"""`flywheel serve teacher`: on-policy distillation's frozen teacher, behind TeacherService.Score.

    rollout ──Score(prompt, G completions)──▶ Batcher (requests that arrive together) ──▶ padded forwards
        ──▶ top-k logits at every completion position (teacher_topk.py) ──▶ TeacherTopK per completion

Rollout calls it for each finished group before publishing the group (rollout/teacher_client.py), so the
teacher works while the engine generates the next groups. The teacher shares the student's vocabulary;
a token id outside it, an empty or oversized request is refused with INVALID_ARGUMENT. It holds no state
between calls: a killed server is restarted and the groups waiting on it are scored then.

Verified here on CPU only (float32 and bfloat16 tiny models); on a GPU it runs the same code on cuda, not
measured here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from services.common.config import FlywheelConfig
from services.common.modeling import build_tiny_tokenizer, model_config
from services.common.pb.flywheel.v1 import rollout_pb2, rollout_pb2_grpc, types_pb2
from services.common.server import SerialThread, run_service
from services.common.telemetry import setup_telemetry
from services.rollout.teacher_topk import Row, check_request, chunks, completion_topk, padded

log = logging.getLogger("flywheel.teacher")


def load_teacher(cfg: FlywheelConfig, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The teacher model in eval mode and teacher.precision. "tiny": policy.tiny with teacher.tiny on top, the
    tiny tokenizer's vocabulary, weights from teacher.seed; else AutoModelForCausalLM (a Hugging Face id or path,
    or a `flywheel export` directory)."""
    t = cfg.teacher
    dtype = getattr(torch, t.precision)
    if t.model_name == "tiny":
        shape = cfg.policy.model_copy(update={"tiny": cfg.teacher_tiny})
        with torch.random.fork_rng():
            torch.manual_seed(t.seed)
            model = AutoModelForCausalLM.from_config(model_config(shape, len(build_tiny_tokenizer())),
                                                     dtype=torch.float32).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(t.model_name, dtype=dtype)
    vocab = model.get_input_embeddings().num_embeddings
    if t.topk_logits_k > vocab:
        raise ValueError(f"teacher.topk_logits_k {t.topk_logits_k} is more than the teacher's {vocab} tokens")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and positions < cfg.policy.max_total_sequence_length:
        raise ValueError(f"teacher {t.model_name!r} takes {positions} positions, fewer than the "
                         f"{cfg.policy.max_total_sequence_length} of policy.max_total_sequence_length it must score")
    return model.to(device).eval()


class Teacher:
    """Scores rows with the model: `max_batch_tokens` padded tokens a forward, top-k at completion positions."""

    def __init__(self, model: torch.nn.Module, *, k: int, max_len: int, max_batch_tokens: int) -> None:
        self.model = model
        self.k, self.max_len, self.max_batch_tokens = k, max_len, max_batch_tokens
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        # Only the positions from the first completion's on are turned into logits, where the model allows it:
        # a long prompt's [P, V] logits would otherwise be most of the forward's memory.
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def check(self, prompt: list[int], completions: list[list[int]]) -> None:
        check_request(prompt, completions, vocab_size=self.vocab_size, max_len=self.max_len)

    @torch.inference_mode()
    def score(self, rows: list[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for chunk in chunks(rows, self.max_batch_tokens):
            ids, mask = padded(chunk, pad_id=0)  # any id: the mask hides it, and it comes after the row's tokens
            offset = min(r.start for r in chunk) if self.keeps_logits else 0
            extra = {"logits_to_keep": ids.shape[1] - offset} if self.keeps_logits else {}
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **extra).logits
            out += completion_topk(logits, chunk, self.k, offset)
        return out


@dataclass(kw_only=True, slots=True)
class _Pending:
    rows: list[Row]
    future: asyncio.Future


class Batcher:
    """Runs the rows of requests that arrive together in the same forwards, one batch at a time on one thread.

    A batch takes what is queued when the thread is free, after waiting at most `wait_s` for more, up to
    `max_tokens` unpadded tokens; a request is never split between batches."""

    def __init__(self, teacher: Teacher, *, wait_s: float, max_tokens: int) -> None:
        self.teacher, self.wait_s, self.max_tokens = teacher, wait_s, max_tokens
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.thread = SerialThread("teacher")
        self.task: asyncio.Task | None = None

    async def score(self, rows: list[Row]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.task is None:
            self.task = asyncio.create_task(self._run())
        pending = _Pending(rows=rows, future=asyncio.get_running_loop().create_future())
        await self.queue.put(pending)
        return await pending.future

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            rows = [row for p in batch for row in p.rows]
            try:
                results = await self.thread.call(self.teacher.score, rows)
            except Exception as err:  # a forward that failed fails each request in it, not the server
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(err)
                continue
            for p in batch:
                if not p.future.done():  # a caller that gave up (deadline) has cancelled its future
                    p.future.set_result(results[:len(p.rows)])
                results = results[len(p.rows):]

    async def _next_batch(self) -> list[_Pending]:
        batch = [await self.queue.get()]
        size = sum(len(r.ids) for r in batch[0].rows)
        deadline = asyncio.get_running_loop().time() + self.wait_s
        while size < self.max_tokens:
            try:
                nxt = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except (asyncio.TimeoutError, TimeoutError):
                break
            batch.append(nxt)
            size += sum(len(r.ids) for r in nxt.rows)
        return batch


def to_proto(k: int, scored: list[tuple[torch.Tensor, torch.Tensor]]) -> rollout_pb2.ScoreResponse:
    return rollout_pb2.ScoreResponse(teacher=[types_pb2.TeacherTopK(
        k=k, logits=values.flatten().tolist(), token_ids=ids.flatten().tolist()) for values, ids in scored])


class TeacherServicer(rollout_pb2_grpc.TeacherServiceServicer):
    """Score: validate, batch, encode."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    async def Score(self, request, context):
        prompt = list(request.prompt_token_ids)
        completions = [list(c.ids) for c in request.completions]
        self.batcher.teacher.check(prompt, completions)
        rows = [Row(ids=prompt + ids, n=len(ids)) for ids in completions]
        return to_proto(self.batcher.teacher.k, await self.batcher.score(rows))


async def serve(cfg: FlywheelConfig) -> None:
    if not cfg.uses_teacher:
        raise SystemExit("flywheel serve teacher: the config has no teacher section")
    setup_telemetry("teacher", cfg.run.name, cfg.telemetry)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Loaded before the port opens: rollout's calls fail fast meanwhile and are retried (teacher_client.py).
    t = cfg.teacher
    teacher = Teacher(load_teacher(cfg, device), k=t.topk_logits_k, max_len=cfg.policy.max_total_sequence_length,
                      max_batch_tokens=t.max_batch_tokens)
    log.info("teacher %s on %s (top-%d)", t.model_name, device, t.topk_logits_k)
    servicer = TeacherServicer(Batcher(teacher, wait_s=t.batch_wait_ms / 1000, max_tokens=t.max_batch_tokens))
    await run_service("teacher", cfg.addresses.teacher,
                      lambda server: rollout_pb2_grpc.add_TeacherServiceServicer_to_server(servicer, server),
                      security=cfg.security)

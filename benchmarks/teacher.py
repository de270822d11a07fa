"""Teacher scoring tokens/s: `flywheel serve teacher` over gRPC vs the same model's forward + top-k in one process.

    python benchmarks/teacher.py [--requests 16] [--completions 8] [--prompt 64] [--tokens 192] [--k 64]
                                 [--hidden 256] [--layers 4] [--repeats 3]

The same requests (a prompt and G completions of random token ids each) both ways, one at a time, so both sides
run the same forwards: directly, Teacher.score on the request's rows (teacher.py, the code the server runs);
through the service, a Score call to a real `flywheel serve teacher` child process, its reply parsed into
TeacherTopK messages. Both use one torch thread (the child's OMP_NUM_THREADS=1, as `flywheel up` gives its
children; torch.set_num_threads(1) here). The model is the tiny teacher at --hidden/--layers with the tiny
tokenizer's vocabulary. Prints completion tokens/s of each side and their ratio, per repeat, in turns.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.common.config import load_config, write_resolved  # noqa: E402
from services.common.infra import child_env, free_port  # noqa: E402
from services.common.pb.flywheel.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.common.server import channel  # noqa: E402
from services.rollout.teacher import Teacher, load_teacher  # noqa: E402
from services.rollout.teacher_topk import Row  # noqa: E402


def requests(a, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
    rng = random.Random(0)
    return [([rng.randrange(vocab) for _ in range(a.prompt)],
             [[rng.randrange(vocab) for _ in range(a.tokens)] for _ in range(a.completions)])
            for _ in range(a.requests)]


def direct(teacher: Teacher, reqs) -> float:
    t0 = time.perf_counter()
    for prompt, completions in reqs:
        teacher.check(prompt, completions)
        teacher.score([Row(ids=prompt + c, n=len(c)) for c in completions])
    return time.perf_counter() - t0


async def service(address: str, reqs) -> float:
    async with channel(address) as ch:
        stub = rollout_pb2_grpc.TeacherServiceStub(ch)
        msgs = [rollout_pb2.ScoreRequest(prompt_token_ids=p, completions=[rollout_pb2.TokenIds(ids=c) for c in cs])
                for p, cs in reqs]
        await stub.Score(msgs[0], timeout=600, wait_for_ready=True)  # the server has loaded its model
        t0 = time.perf_counter()
        for m in msgs:
            reply = await stub.Score(m, timeout=600)
            assert len(reply.teacher) == len(m.completions)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("requests", 16), ("completions", 8), ("prompt", 64), ("tokens", 192), ("k", 64),
                          ("hidden", 256), ("layers", 4), ("repeats", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, [
        "++distillation={}", "teacher.model_name=tiny", f"distillation.topk_logits_k={a.k}",
        f"addresses.teacher=127.0.0.1:{free_port()}",
        f"teacher.tiny={{hidden_size: {a.hidden}, num_hidden_layers: {a.layers}, num_attention_heads: "
        f"{max(a.hidden // 64, 1)}, intermediate_size: {2 * a.hidden}}}",
        f"distillation.num_generations_per_prompt={a.completions}",
        f"policy.max_total_sequence_length={a.prompt + a.tokens}",
        f"teacher.max_batch_tokens={a.completions * (a.prompt + a.tokens)}"])
    teacher = Teacher(load_teacher(cfg), k=a.k, max_len=cfg.policy.max_total_sequence_length,
                      max_batch_tokens=cfg.teacher.max_batch_tokens)
    reqs = requests(a, teacher.vocab_size)
    tokens = a.requests * a.completions * a.tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = write_resolved(cfg, tmp)
        server = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "teacher", "--config", str(path)],
                                  env=child_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            print(f"requests={a.requests} completions={a.completions} prompt={a.prompt} tokens={a.tokens} k={a.k} "
                  f"hidden={a.hidden} layers={a.layers} vocab={teacher.vocab_size} load={os.getloadavg()[0]:.2f}")
            asyncio.run(service(cfg.addresses.teacher, reqs[:1]))  # warm both sides
            direct(teacher, reqs[:1])
            for r in range(a.repeats):
                d = tokens / direct(teacher, reqs)
                s = tokens / asyncio.run(service(cfg.addresses.teacher, reqs))
                print(f"repeat {r}: direct {d:9.1f} tok/s   service {s:9.1f} tok/s   ratio {s / d:.3f}", flush=True)
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()

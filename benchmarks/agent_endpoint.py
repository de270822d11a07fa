"""Tokens/s through the OpenAI-compatible endpoint beside the same engine called directly, same requests.

    python benchmarks/agent_endpoint.py [--requests 64] [--concurrency 16] [--max-tokens 16] [--backend hf]
                                        [--repeats 2] [--client-process] [--hidden 64 --layers 2]

One engine (version 0 over gloo, as the trainer delivers it) serves both sides, in turns:
- direct: `engine.generate([prompt_ids], sampling)` per request, `concurrency` at once; the prompt is the chat
  template's rendering of the request's messages, tokenized here beforehand;
- endpoint: the same requests as chat completions through the `openai` SDK (one AsyncOpenAI, in this process so
  that the client's CPU counts against the endpoint, or with --client-process in a process of its own, as agents
  run) to an EndpointServer on loopback, one episode per request, `concurrency` at once: HTTP, JSON, the
  template, the recording and the episode check are all in the clock.
Printed per repeat: generated tokens/s of each side and their ratio (endpoint / direct), and the engine's mean
seconds per batch on the direct side. Results: docs/benchmarks.md.

The model is the locally built tiny one (random weights, its 64-token vocabulary; no model hub here).
--hidden/--layers make it bigger (the tiny model's proportions: intermediate 2 x hidden, heads of 32 to 64), so
that a batch costs hundreds of milliseconds, towards a small real model's on a CPU, rather than tens: the
endpoint's fixed cost per request is then weighed against a more realistic generation time. The vocabulary stays 64, so the output
layer is far cheaper than a real model's (151k for Qwen): the batch time, not the parameter count, is what to
compare.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import threading
import time

import torch
from openai import AsyncOpenAI

from services.common.config import load_config
from services.common.modeling import load_policy
from services.common.weights import WeightSender
from services.rollout.endpoint.server import EndpointServer
from services.rollout.engines import Sampling, make_engine
from services.rollout.episodes import prompt_token_ids
from services.rollout.main import GIL_SWITCH_S


async def ready_engine(cfg):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    engine = make_engine(cfg, "bench-endpoint")
    await engine.start()
    model, _ = load_policy(cfg.policy, cfg.run.seed)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    announced: list = []
    sender = WeightSender(backend="gloo", publish=announced.append)
    sync = threading.Thread(target=sender.sync, args=(0, ["bench-endpoint"], state), kwargs={"timeout_s": 120})
    sync.start()
    while not announced:
        await asyncio.sleep(0.01)
    await engine.load_weights(announced[-1].fields(), timeout_s=120)
    await asyncio.to_thread(sync.join)
    sender.close()
    return engine


async def bounded(n: int, concurrency: int, one) -> int:
    """Run one(i) for i < n, `concurrency` at a time; returns the tokens they generated."""
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> int:
        async with gate:
            return await one(i)

    return sum(await asyncio.gather(*(run(i) for i in range(n))))


async def direct(engine, prompts: list[list[int]], args) -> tuple[float, float]:
    """(tokens/s, seconds per engine batch) of the requests called straight on the engine."""
    sampling = Sampling(max_new_tokens=args.max_tokens)
    batches = []

    async def one(i: int) -> int:
        [out] = await engine.generate([prompts[i]], sampling)
        batches.append(getattr(engine, "_batch_s", 0.0))  # the hf engine's last batch; vllm: none
        return len(out.token_ids)

    t0 = time.perf_counter()
    tokens = await bounded(len(prompts), args.concurrency, one)
    return tokens / (time.perf_counter() - t0), sum(set(batches)) / max(1, len(set(batches)))


async def agents(base_url: str, episodes: list[tuple[str, str]], messages: list[list[dict]], concurrency: int,
                 max_tokens: int) -> tuple[int, float]:
    """The agents' side: (tokens, seconds) of the chat calls, `concurrency` at once."""
    # One client for all (an agent fleet shares connections): each call names its episode by header and token.
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="per-call", max_retries=0)

    async def one(i: int) -> int:
        key, token = episodes[i]
        r = await client.chat.completions.create(
            model="policy", messages=messages[i], max_tokens=max_tokens,
            extra_headers={"X-Flywheel-Session": key, "Authorization": f"Bearer {token}"})
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    tokens = await bounded(len(messages), concurrency, one)
    seconds = time.perf_counter() - t0
    await client.close()
    return tokens, seconds


def agents_process(conn, *args) -> None:
    conn.send(asyncio.run(agents(*args)))


async def through_endpoint(endpoint: EndpointServer, messages: list[list[dict]], args) -> float:
    episodes = [endpoint.open_episode()[:2] for _ in messages]
    load = (endpoint.base_url, episodes, messages, args.concurrency, args.max_tokens)
    if args.client_process:  # as agents run: in processes of their own
        parent, child = multiprocessing.get_context("spawn").Pipe()
        proc = multiprocessing.get_context("spawn").Process(target=agents_process, args=(child, *load))
        proc.start()
        tokens, seconds = await asyncio.to_thread(parent.recv)
        proc.join()
    else:
        tokens, seconds = await agents(*load)
    for key, _ in episodes:
        endpoint.close_episode(key)
    return tokens / seconds


async def main(args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sys.setswitchinterval(GIL_SWITCH_S)  # as the rollout worker runs
    shape = [f"policy.tiny.hidden_size={args.hidden}", f"policy.tiny.num_hidden_layers={args.layers}",
             f"policy.tiny.intermediate_size={2 * args.hidden}",
             f"policy.tiny.num_attention_heads={max(2, args.hidden // 64)}"]
    cfg = load_config(None, [f"policy.generation.backend={args.backend}", "policy.max_total_sequence_length=128",
                             *shape])
    engine = await ready_engine(cfg)
    endpoint = EndpointServer(cfg, engine, "bench-endpoint")
    await endpoint.start()
    messages = [[{"role": "user", "content": f"copy {i % 97} and {i % 13}"}] for i in range(args.requests)]
    prompts = [prompt_token_ids(engine.tokenizer, m) for m in messages]
    await direct(engine, prompts[: args.concurrency], args)  # warm-up, both sides
    await through_endpoint(endpoint, messages[: args.concurrency], args)
    print(f"backend={args.backend} requests={args.requests} concurrency={args.concurrency} "
          f"max_tokens={args.max_tokens} client_process={args.client_process} hidden={args.hidden} "
          f"layers={args.layers} load={os.getloadavg()[0]:.2f}")
    for repeat in range(args.repeats):
        d, batch_s = await direct(engine, prompts, args)
        e = await through_endpoint(endpoint, messages, args)
        print(f"repeat {repeat}: direct {d:8.1f} tok/s   endpoint {e:8.1f} tok/s   ratio {e / d:.3f}   "
              f"batch {batch_s * 1e3:.0f} ms   load {os.getloadavg()[0]:.1f}")
    await endpoint.stop()
    await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--client-process", action="store_true",
                        help="the agents' SDK calls from a process of their own (their CPU off the clock's process)")
    parser.add_argument("--hidden", type=int, default=64, help="the built model's hidden size (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2, help="the built model's layers (tiny: 2)")
    asyncio.run(main(parser.parse_args()))

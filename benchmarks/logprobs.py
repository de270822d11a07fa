"""Peak memory and time of the trainer's token logprobs, forward + backward: whole rows vs policy.logprob_chunk_size.

    python benchmarks/logprobs.py [--rows 1] [--tokens 4096] [--vocab 32000] [--chunks 0,1024,256]

Each setting runs in a fresh process (peak RSS is per process), on logits that require grad as a model's would.
"plain" is the textbook log_softmax(logits.float() / T).gather(...); chunk 0 is token_logprobs in one chunk.
Prints, for each, the peak RSS above the logits themselves and the seconds of one forward + backward, and both
as a ratio to plain from the same run. The gradient of the logits (1x their size) is the floor of any method.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(rows: int, tokens: int, vocab: int, chunk: int | None, plain: bool) -> dict:
    import torch

    from services.common.modeling import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(rows, tokens, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (rows, tokens))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if plain:
        out = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    else:
        out = token_logprobs(logits, targets, 0.7, chunk)
    out.sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"extra_mb": (peak - base) / 1024, "logits_mb": logits.numel() * 4 / 2**20, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunks", default="0,1024,256", help="0: one chunk")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(child(a.rows, a.tokens, a.vocab, spec["chunk"], spec["plain"])))
        return
    settings = [("plain", {"chunk": None, "plain": True})]
    settings += [(f"chunk {c or 'whole'}", {"chunk": c or None, "plain": False}) for c in map(int, a.chunks.split(","))]
    print(f"rows {a.rows}, tokens {a.tokens}, vocab {a.vocab}: forward + backward of the token logprobs")
    print(f"{'setting':<14}{'extra peak MB':>14}{'x logits':>10}{'seconds':>10}{'memory/plain':>14}{'time/plain':>12}")
    first = None
    for name, spec in settings:
        out = subprocess.run([sys.executable, __file__, "--rows", str(a.rows), "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--child", json.dumps(spec)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        first = first or r
        print(f"{name:<14}{r['extra_mb']:>14.0f}{r['extra_mb'] / r['logits_mb']:>10.2f}{r['seconds']:>10.3f}"
              f"{r['extra_mb'] / first['extra_mb']:>14.2f}{r['seconds'] / first['seconds']:>12.2f}")


if __name__ == "__main__":
    main()

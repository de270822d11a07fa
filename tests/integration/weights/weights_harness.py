"""Test harness for the weight channel: deterministic model states and receiver worker processes.

A receiver worker (`python weights_harness.py ...`) follows announcements through the trainer's TCPStore
(`announce/latest`), receives every epoch it is a member of, checks the bytes against the state it expects
for that version, and prints one JSON line per outcome. Used only by tests and the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def make_state(version: int, *, n_small: int = 40, large_numel: int = 300_000) -> dict[str, torch.Tensor]:
    """Many small tensors of mixed dtypes and one large one; contents depend on `version` only."""
    g = torch.Generator().manual_seed(1000 + version)
    state: dict[str, torch.Tensor] = {}
    for i in range(n_small):
        dtype = DTYPES[i % len(DTYPES)]
        shape = (1 + i % 7, 3 + i % 5) if i % 3 else (5 + i,)
        if dtype == torch.int64:
            state[f"layers.{i}.w"] = torch.randint(-(2**40), 2**40, shape, generator=g)
        else:
            state[f"layers.{i}.w"] = torch.randn(shape, generator=g).to(dtype)
    state["embed.weight"] = torch.randn(large_numel, generator=g)
    return state


def empty_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


def spawn(store_address: str, worker_id: str, *, backend: str = "gloo", versions: int = 1, n_small: int = 40,
          large_numel: int = 300_000, sleep_per_bucket: float = 0.0, timeout_s: float = 15.0,
          device: str = "cpu", deadlines: str = "") -> subprocess.Popen:
    """Start a receiver worker process; it exits after receiving `versions` versions. `deadlines="nccl"` runs a
    gloo receiver under nccl's deadline rule (backends/collective.py, DEADLINES)."""
    cmd = [sys.executable, __file__, "--store", store_address, "--worker-id", worker_id, "--backend", backend,
           "--versions", str(versions), "--n-small", str(n_small), "--large-numel", str(large_numel),
           "--sleep-per-bucket", str(sleep_per_bucket), "--timeout", str(timeout_s), "--device", device,
           "--deadlines", deadlines or backend]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Wait until it has imported torch and built its receiver, so join timeouts measure the protocol only.
    for line in proc.stdout:  # NIXL logs to stdout too: skip to our line
        if line.startswith('{"event": "ready"'):
            return proc
    proc.kill()
    raise AssertionError(f"receiver did not start: {proc.stderr.read()[-2000:]}")


def signal_once_joined(sender, worker_id: str, proc: subprocess.Popen, sig: int, *, after_s: float) -> None:
    """On a daemon thread: wait until `worker_id` joined the first round (epoch 1, version 1), let `after_s`
    pass (so the transfer is under way), then send `sig` to `proc`."""

    def run() -> None:
        limit = time.monotonic() + 10
        while not sender.store.check([f"epoch/1/v1/joined/{worker_id}"]) and time.monotonic() < limit:
            time.sleep(0.01)
        time.sleep(after_s)
        os.kill(proc.pid, sig)

    threading.Thread(target=run, daemon=True).start()


def outcomes(proc: subprocess.Popen, timeout: float = 20.0) -> list[dict]:
    """Wait for a worker and parse its JSON lines."""
    out, err = proc.communicate(timeout=timeout)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    if not lines and proc.returncode != 0:
        raise AssertionError(f"receiver failed rc={proc.returncode}: {err[-2000:]}")
    return lines


def _slow_unpack(backend: str, seconds: float) -> None:
    """Make every unpacked bucket take `seconds` longer (a slow receiver for kill/stall tests)."""
    import importlib

    module = importlib.import_module(
        f"services.common.weights.backends.{'collective' if backend in ('gloo', 'nccl') else backend}"
    )
    real = module.unpack

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    module.unpack = slow


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--versions", type=int, default=1)
    p.add_argument("--n-small", type=int, default=40)
    p.add_argument("--large-numel", type=int, default=300_000)
    p.add_argument("--sleep-per-bucket", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--deadlines", default="")
    a = p.parse_args()
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))

    from services.common.weights import EpochAbandoned, TransferFailed, WeightReceiver, poll_announcement

    if a.sleep_per_bucket:
        _slow_unpack(a.backend, a.sleep_per_bucket)
    receiver = WeightReceiver(a.worker_id, a.backend, host="127.0.0.1")
    if a.deadlines and a.deadlines != a.backend:
        from services.common.weights.backends.collective import DEADLINES

        receiver.backend.deadlines = DEADLINES[a.deadlines]
    state0 = make_state(0, n_small=a.n_small, large_numel=a.large_numel)
    into = {k: v.to(a.device) for k, v in empty_like_state(state0).items()}
    print(json.dumps({"event": "ready"}), flush=True)
    after, done, deadline = (0, 0), 0, time.monotonic() + a.timeout
    while done < a.versions and time.monotonic() < deadline:
        ann = poll_announcement(a.store, newer_than=after, timeout_s=deadline - time.monotonic())
        if ann is None:
            break
        after = ann.order
        if a.worker_id not in ann.members:
            continue
        try:
            value = receiver.receive(ann, into, timeout_s=max(0.1, deadline - time.monotonic()))
        except (EpochAbandoned, TransferFailed) as exc:
            print(json.dumps({"event": "failed", "epoch": ann.epoch, "error": str(exc)[:300]}), flush=True)
            continue
        expected = make_state(ann.version, n_small=a.n_small, large_numel=a.large_numel)
        print(json.dumps({"event": "received", "version": ann.version, "epoch": ann.epoch, "checksum": value,
                          "equal": bitwise_equal({k: v.cpu() for k, v in into.items()}, expected)}),
              flush=True)
        done += 1
    receiver.close()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _main()

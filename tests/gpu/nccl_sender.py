"""A trainer-side weight sender in its own process, for the GPU check's nccl checks (gloo on the CPU dry run).

Prints {"store": host:port} once its store listens. Then for each round in `--rounds` ("w0" or "w1;w2":
members, comma-separated, one round per `;`) it waits for a line on stdin (the caller has started that round's
receivers), syncs weights_harness.make_state(round number) to them and prints the SyncResult as one JSON line.
Exit code 0 whenever every sync returned, whatever its outcome: a crash or a hang here is what the checks
look for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "integration" / "weights")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--backend", default="nccl", help="gloo (with --device cpu): the CPU dry run")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--rounds", default="w0")
    p.add_argument("--large-numel", type=int, default=300_000)
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    a = p.parse_args()
    import torch

    from services.common.weights import WeightSender
    from weights_harness import make_state

    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    sender = WeightSender(backend=a.backend, bucket_bytes=a.bucket_bytes)
    print(json.dumps({"store": sender.store_address}), flush=True)
    for version, members in enumerate(a.rounds.split(";"), start=1):
        sys.stdin.readline()
        state = {k: v.to(a.device) for k, v in make_state(version, large_numel=a.large_numel).items()}
        result = sender.sync(version, members.split(","), state, timeout_s=a.timeout)
        print(json.dumps(dataclasses.asdict(result)), flush=True)
    sender.close()


if __name__ == "__main__":
    main()

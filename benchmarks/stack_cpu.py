"""CPU seconds per step of each process of a local stack, for the benchmarks that print CPU per step."""

from __future__ import annotations

import psutil

from services.local import LocalStack, read_metrics

MARGIN = 10
"""Steps before the run's last at which the window closes: the trainer exits after its last step (and a
child that is gone has no CPU left to read), and wait_for polls every 0.3 s, several steps at a time."""


def cpu_seconds(stack: LocalStack) -> dict[str, float]:
    """user + system CPU seconds of each child of the stack so far, its own children included (vLLM's engine
    core and worker)."""
    out = {}
    for name, proc in stack.children.procs.items():
        parent = psutil.Process(proc.pid)  # NoSuchProcess if the child is gone: its CPU can no longer be read
        out[name] = sum(sum(p.cpu_times()[:2]) for p in [parent, *parent.children(recursive=True)])
    return out


def cpu_per_step(stack: LocalStack, first: int, steps: int) -> dict[str, float]:
    """CPU seconds per step of each child, from the `first`-th step's metrics row to MARGIN steps before the
    run's last (`steps`)."""
    run_dir = stack.children.run_dir
    if steps - MARGIN <= first:
        raise ValueError(f"a run of {steps} steps leaves no CPU window after step {first}; run more steps")
    stack.wait_for(lambda rows: len(rows) >= first, f"{first} steps", timeout_s=3600)
    start, begun = cpu_seconds(stack), len(read_metrics(run_dir))
    stack.wait_for(lambda rows: len(rows) >= steps - MARGIN, "the end of the CPU window", timeout_s=3600)
    end, ended = cpu_seconds(stack), len(read_metrics(run_dir))
    return {name: (end[name] - start[name]) / (ended - begun) for name in end}

"""CPU seconds used so far by the processes of a local stack, for the benchmarks that print CPU per step."""

from __future__ import annotations

import psutil

from services.local import LocalStack


def cpu_seconds(stack: LocalStack) -> dict[str, float]:
    """user + system CPU seconds of each child of the stack so far, its own children included (vLLM's engine
    core and worker); 0 for a child that is gone."""
    out = {}
    for name, proc in stack.children.procs.items():
        try:
            parent = psutil.Process(proc.pid)
            out[name] = sum(sum(p.cpu_times()[:2]) for p in [parent, *parent.children(recursive=True)])
        except psutil.NoSuchProcess:
            out[name] = 0.0
    return out

"""Which of a run's services hold GPU memory, as nvidia-smi sees it: an oracle outside the code tested."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from pathlib import Path

SERVE = re.compile(r"services\.cli\x00serve\x00(\w+)")


def compute_apps() -> dict[int, int]:
    """pid -> MiB of GPU memory, for every process nvidia-smi lists; {} without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return {}
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
    apps = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit():
            apps[int(pid)] = int(mib.strip() or 0) if mib.strip().isdigit() else 0
    return apps


def memory_used_mib() -> int | None:
    """GPU 0's used memory in MiB, or None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    return int(out) if out.isdigit() else None


def service_of(pid: int) -> str | None:
    """The `flywheel serve NAME` a process is, or descends from (trainer ranks); None if none."""
    for _ in range(16):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        found = SERVE.search(cmdline)
        if found:
            return found.group(1)
        pid = int(stat.rpartition(")")[2].split()[1])  # field 4, after the command name in parentheses
        if pid <= 1:
            return None
    return None


class Watcher:
    """Samples nvidia-smi every `period_s` on a thread: services seen on the GPU, and peak memory used."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.services: dict[str, int] = {}
        """Service name -> the most MiB one of its processes held."""
        self.unattributed = 0
        """Samples of GPU processes that belong to no service (another job; ours behind a PID namespace)."""
        self.peak_mib = 0
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self.baseline_mib = memory_used_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for pid, mib in compute_apps().items():
                name = service_of(pid)
                if name is None:
                    self.unattributed += 1
                else:
                    self.services[name] = max(self.services.get(name, 0), mib)
            self.peak_mib = max(self.peak_mib, memory_used_mib() or 0)

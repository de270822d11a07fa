"""Faults for the chaos run (kill -9, SIGSTOP/SIGCONT) and what /proc says each one did.

The schedule says what the harness meant to do; `inject` returns what the kernel shows happened, read from
/proc rather than from the supervisor: the killed process is gone (or a zombie awaiting its reaper) and a new
process with its command line runs as a child of this one; the paused one had every thread in state T (stopped)
from just after SIGSTOP to just before SIGCONT, and ran again after.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PAUSE_S = 6.0
"""Longer than the trainer's liveness window (5 s): a paused worker is dropped from the sync and rejoins."""
RESTART_WITHIN_S = 120.0
SURVIVOR_GRACE_S = 15.0
"""How long a killed process's descendants may take to exit once its successor runs."""


@dataclass(frozen=True, slots=True)
class Fault:
    step: int
    """Steps the trainer has finished when the fault lands."""
    action: str
    """"kill" (SIGKILL) or "pause" (SIGSTOP, SIGCONT after PAUSE_S)."""
    target: str


@dataclass(frozen=True, slots=True)
class Observed:
    fault: Fault
    pid: int
    """The process the fault hit."""
    died: bool = False
    """kill: /proc/<pid> vanished or turned zombie after SIGKILL."""
    successor: int | None = None
    """kill: a live child of this process with the killed one's command line, found in /proc."""
    stopped: bool = False
    """pause: every thread in state T just after SIGSTOP and still at the end of the pause, not T after SIGCONT."""
    survivors: tuple[int, ...] = ()
    """kill: the killed process's descendants (vLLM's engine core, a trainer's ranks) still running once its
    successor runs: a survivor would hold its ports and memory beside the new process."""

    @property
    def happened(self) -> bool:
        if self.fault.action == "kill":
            return self.died and self.successor not in (None, self.pid) and not self.survivors
        return self.stopped


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state first); empty once the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


def state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (R, S, T, Z, ...); None once the pid is gone."""
    return next(iter(_stat(pid)), None)


def threads_stopped(pid: int) -> bool:
    """Whether every thread of `pid` is in state T. A SIGSTOP stops a process's threads one by one: the thread
    that takes the signal stops the others, and until it runs (on a loaded host, a while) the others go on, so a
    Go server's network thread can still answer after kill() returned."""
    states = [state(int(tid.name)) for tid in Path(f"/proc/{pid}/task").glob("*")]
    return bool(states) and all(s in ("T", "t") for s in states)


def stop(pid: int, timeout_s: float = 30.0) -> None:
    """SIGSTOP `pid` and return once all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    if not _until(lambda: threads_stopped(pid), timeout_s, 0.01):
        raise TimeoutError(f"pid {pid} was not stopped {timeout_s} s after SIGSTOP")


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _exec_argv(pid: int) -> list[str]:
    """The command line a child runs, once it has exec'd: until then /proc shows it empty, as its parent's (a
    large parent forks slowly, so a child just started is often caught there) or as setpriv's
    (infra.dying_with_parent)."""
    own = _argv(os.getpid())

    def execd() -> list[str] | None:
        argv = _argv(pid)
        return argv if argv and argv != own and os.path.basename(argv[0]) != "setpriv" else None

    return _until(execd, 10) or []


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else None


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks after boot): with the pid, it names one process, not a reused pid."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None


def descendants(pid: int) -> dict[int, str | None]:
    """Every process below `pid` in /proc's parent links at this moment, with its start time."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (parent := _parent(int(entry.name))) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = _started(child)
                todo.append(child)
    return found


def _alive(pid: int, started: str | None) -> bool:
    return state(pid) not in (None, "Z") and _started(pid) == started


def _identity(argv: list[str]) -> tuple:
    """What a restart keeps: a service's whole command line; a broker's binary and port (its monitor port is new)."""
    if "serve" in argv:
        return tuple(argv)
    for flag in ("-p", "--port"):
        if flag in argv:
            return os.path.basename(argv[0]), argv[argv.index(flag) + 1]
    return tuple(argv)


def _successor(killed: int, identity: tuple) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != killed and _parent(int(entry.name)) == os.getpid():
            pid = int(entry.name)
            if state(pid) not in (None, "Z") and _identity(_argv(pid)) == identity:
                return pid
    return None


def _until(check, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    return check()


def inject(stack, fault: Fault, *, pause_s: float = PAUSE_S, restart_within_s: float = RESTART_WITHIN_S) -> Observed:
    """Apply `fault` to the stack's child `fault.target`; for a kill, supervise until its successor runs."""
    pid = stack.children.procs[fault.target].pid
    if fault.action == "kill":
        identity, below = _identity(_exec_argv(pid)), descendants(pid)
        os.kill(pid, signal.SIGKILL)
        died = bool(_until(lambda: state(pid) in (None, "Z"), 10))

        def restarted() -> int | None:
            stack.children.supervise()  # reaps the zombie, restarts after the back-off
            return _successor(pid, identity)

        successor = _until(restarted, restart_within_s, 0.2)

        def alive() -> tuple[int, ...]:
            return tuple(sorted(p for p, started in below.items() if _alive(p, started)))

        # A SIGKILLed process with a large address space (vLLM's engine core) can take seconds to finish exiting.
        _until(lambda: not alive(), SURVIVOR_GRACE_S)
        survivors = alive()
        return Observed(fault=fault, pid=pid, died=died, successor=successor, survivors=survivors)
    os.killpg(pid, signal.SIGSTOP)  # the service's whole process group (vLLM's engine core included)
    stopped = bool(_until(lambda: threads_stopped(pid), 30, 0.01))  # every thread, as `stop` waits for
    time.sleep(pause_s)
    stopped = stopped and threads_stopped(pid)
    os.killpg(pid, signal.SIGCONT)
    resumed = bool(_until(lambda: state(pid) not in ("T", None), 5))
    return Observed(fault=fault, pid=pid, stopped=stopped and resumed)

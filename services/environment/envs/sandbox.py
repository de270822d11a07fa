"""Runs untrusted Python (a solution, then its assert tests) in a confined subprocess; the caller survives.

Parent side; the child side is `sandbox_child.py`. Per run:
- a fresh temporary work dir is the child's cwd and the only place it may write;
- the child is `python -I -S` (no site-packages, no PYTHON* variables) with a minimal environment, in a
  new session, so its whole process group can be killed;
- the child confines itself before any untrusted code runs (network namespace, rlimits, and a
  dedicated uid when we are root) instead of in a preexec_fn, which can deadlock in a threaded server;
- after `wall_s` the process group is SIGKILLed; stragglers of the dedicated uid are killed too;
- stdout and stderr go to files, so their size is bounded by RLIMIT_FSIZE, not by our memory;
- the verdict is a JSON report on a private pipe, tagged with a per-run nonce, so printing a fake
  verdict or exiting early (os._exit(0)) never counts as a pass.
A determined program can still find the nonce in the bootstrap's frames; that buys it only a wrong
reward, never an escape, since containment is the kernel's (namespace, uid, rlimits).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHILD_SOURCE = (Path(__file__).parent / "sandbox_child.py").read_text()
MINIMAL_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
PRELOAD = (
    "array", "bisect", "cmath", "collections", "contextlib", "copy", "dataclasses", "datetime", "decimal",
    "encodings.idna", "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "json", "linecache",
    "math", "numbers", "operator", "pprint", "queue", "random", "re", "statistics", "string", "struct",
    "textwrap", "time", "tokenize", "typing",
)
"""Stdlib modules imported before the uid drop: the stdlib may be unreadable to the sandbox uid."""
SANDBOX_UID_BASE = 1_500_000_000
"""Dedicated uids come from [base, base + 2**20): far above real users, so killing them all is safe."""
NOBODY = 65534
TAIL_BYTES = 2000


@dataclass(kw_only=True, slots=True, frozen=True)
class SandboxLimits:
    """Per-run limits. The defaults suit short competitive-programming style tests."""

    wall_s: float = 10.0
    """Wall-clock deadline in seconds, after which the process group is SIGKILLed."""
    cpu_s: int = 10
    """RLIMIT_CPU in seconds of CPU time per process."""
    memory_mb: int = 512
    """RLIMIT_AS in MiB of address space per process."""
    max_processes: int = 16
    """RLIMIT_NPROC: processes and threads of the sandbox user, the first process included."""
    max_file_mb: float = 16.0
    """RLIMIT_FSIZE in MiB: the largest file the program may write, stdout and stderr included."""
    max_open_files: int = 64
    """RLIMIT_NOFILE: file descriptors per process."""


@dataclass(kw_only=True, slots=True)
class SandboxOutcome:
    passed: bool
    """The solution and every test ran to the end without an exception or a violation."""
    error: str
    """Why the sandbox stopped or refused the program ("timeout", "memory", "network", "filesystem",
    "processes", "file size", "exit code N", "signal NAME"); "" when it ran to its end."""
    detail: str
    """The exception that failed the tests, e.g. "AssertionError: ..."; "" when none."""
    stdout: str
    """The last TAIL_BYTES of stdout."""
    stderr: str
    """The last TAIL_BYTES of stderr (tracebacks)."""
    network_isolated: bool
    """The child got its own network namespace (False: only the socket guard stood in the way)."""


def run_python(solution: str, tests: str, limits: SandboxLimits) -> SandboxOutcome:
    """Runs `solution` then `tests` in one namespace in a confined child process."""
    with tempfile.TemporaryDirectory(prefix="flywheel-sandbox-", ignore_cleanup_errors=True) as root:
        workdir = os.path.realpath(os.path.join(root, "work"))
        os.mkdir(workdir)
        uid = _sandbox_uid()
        if uid is not None:
            os.chmod(root, 0o711)  # the sandbox uid may pass through to work/, but not list or read root
            os.chown(workdir, uid, uid)
        nonce = secrets.token_hex(16)
        job = {"workdir": workdir, "solution": solution, "tests": tests, "nonce": nonce, "uid": uid,
               "preload": PRELOAD, "limits": _child_limits(limits)}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with open(out_path, "w+b") as out, open(err_path, "w+b") as err:
            timed_out, returncode, raw_report = _run_child(job, out, err, limits.wall_s)
            if raw_report is None and uid is not None:
                _kill_uid(uid)
            stdout, stderr = _tail(out), _tail(err)
    report = _parse_report(raw_report, nonce)
    if timed_out:
        passed, error, detail = False, "timeout", ""
    elif report is not None:
        passed, error, detail = bool(report["passed"]), str(report["error"]), str(report.get("detail", ""))
    else:
        passed, error, detail = False, _exit_error(returncode), ""
    return SandboxOutcome(passed=passed, error=error, detail=detail, stdout=stdout, stderr=stderr,
                          network_isolated=bool(report and report.get("network_isolated")))


def _run_child(job: dict, out, err, wall_s: float) -> tuple[bool, int, bytes | None]:
    read_end, write_end = os.pipe()
    job["result_fd"] = write_end
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", CHILD_SOURCE],
            stdin=subprocess.PIPE, stdout=out, stderr=err, pass_fds=(write_end,),
            cwd=job["workdir"], env=MINIMAL_ENV, start_new_session=True,
        )
    finally:
        os.close(write_end)
    try:
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)
        proc.wait()
        os.set_blocking(read_end, False)
        try:
            raw = os.read(read_end, 1 << 16)
        except BlockingIOError:  # a straggler still holds the write end and wrote nothing
            raw = b""
    finally:
        os.close(read_end)
    return timed_out, proc.returncode, raw or None


def _child_limits(limits: SandboxLimits) -> dict:
    return {
        "cpu_s": max(1, int(limits.cpu_s)),
        "memory_bytes": int(limits.memory_mb * 2**20),
        "max_processes": limits.max_processes,
        "max_file_bytes": int(limits.max_file_mb * 2**20),
        "max_open_files": limits.max_open_files,
    }


def _sandbox_uid() -> int | None:
    """A fresh unprivileged uid to run as when we are root (RLIMIT_NPROC ignores root); else None."""
    if os.geteuid() != 0:
        return None
    candidate = SANDBOX_UID_BASE + random.randrange(2**20)
    for uid in (candidate, NOBODY):
        if _mapped(uid, "/proc/self/uid_map") and _mapped(uid, "/proc/self/gid_map"):
            return uid
    return None


def _mapped(ident: int, map_path: str) -> bool:
    """Whether `ident` exists in this user namespace (/proc/self/{uid,gid}_map: inside outside count)."""
    try:
        lines = Path(map_path).read_text().splitlines()
    except OSError:
        return ident < 2**16  # no user namespaces: the classic id space
    for line in lines:
        inside, _, count = (int(x) for x in line.split())
        if inside <= ident < inside + count:
            return True
    return False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    """Kills every process of the dedicated sandbox uid, from a helper that becomes that uid."""
    if uid == 0:
        return
    helper = "import os,signal,sys; u=int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u); " \
             "os.kill(-1, signal.SIGKILL)"
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", helper, str(uid)], env=MINIMAL_ENV,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _parse_report(raw: bytes | None, nonce: str) -> dict | None:
    """The child's report if it carries this run's nonce; a forged or missing one gives None."""
    for line in reversed((raw or b"").splitlines()):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and report.get("nonce") == nonce:
            return report
    return None


def _exit_error(returncode: int) -> str:
    if returncode >= 0:
        return f"exit code {returncode}"
    if -returncode == signal.SIGXCPU:
        return "timeout"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def _tail(file) -> str:
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(max(0, size - TAIL_BYTES))
    return file.read().decode("utf-8", errors="replace")

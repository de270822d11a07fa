"""Structured logging: one logfmt line per event, tagged with run id and service."""

from __future__ import annotations

import logging
import sys
import time


class _LogfmtFormatter(logging.Formatter):
    def __init__(self, service: str, run: str) -> None:
        super().__init__()
        self._prefix = f"service={service} run={run}"

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"ts={ts} level={record.levelname.lower()} {self._prefix} msg={record.getMessage()!r}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class ClientGone(logging.Filter):
    """gRPC logs an ExecuteBatchError, traceback and all, when a server cannot send a call's error status
    because the client has already gone (its deadline passed, it cancelled): any caller with a tiny deadline
    can cause one, nothing of ours failed, and nothing can be done. It becomes a one-line warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ == "ExecuteBatchError":
            record.msg, record.args = f"{record.getMessage()}: the client had gone before its status was sent", None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def setup_logging(service: str, run: str, level: str = "INFO") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogfmtFormatter(service, run))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("nats", "httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    grpc_core = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, ClientGone) for f in grpc_core.filters):
        grpc_core.addFilter(ClientGone())
    return logging.getLogger(f"flywheel.{service}")


def event(log: logging.Logger, msg: str, **fields: object) -> None:
    """Log one event with key=value fields."""
    log.info(msg, extra={"fields": fields})


class RateLimitedLog:
    """At most one record per `period_s` per key; the next one says how many were suppressed.

    Client mistakes (undecodable requests, bad tokens) are the caller's problem, and a flood of
    them must not fill the log: a stray client would bury every other event."""

    def __init__(self, logger: logging.Logger, period_s: float = 10.0) -> None:
        self.logger = logger
        self.period_s = period_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.period_s) < self.period_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        self.logger.warning(message + (f" ({suppressed} more since the last report)" if suppressed else ""), *args)

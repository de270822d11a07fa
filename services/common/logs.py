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


def setup_logging(service: str, run: str, level: str = "INFO") -> logging.Logger:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LogfmtFormatter(service, run))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("nats", "httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"flywheel.{service}")


def event(log: logging.Logger, msg: str, **fields: object) -> None:
    """Log one event with key=value fields."""
    log.info(msg, extra={"fields": fields})

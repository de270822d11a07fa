"""The shared log setup: one logfmt line per event, and gRPC's noise about clients that left kept to a line."""

from __future__ import annotations

import logging

import pytest
from grpc._cython import cygrpc

from services.common.logs import setup_logging


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def _log_from_grpc_core(error: Exception) -> None:
    """What gRPC's server does when sending a call's status fails: log the exception on its own logger."""
    setup_logging("svc", "run")  # here, so that its handler writes to the stderr capsys captures now
    try:
        raise error
    except Exception:
        logging.getLogger("grpc._cython.cygrpc").exception("ExecuteBatchError raised in core by servicer method [/x]")


def test_a_status_the_client_left_before_is_a_warning_line_without_a_traceback(capsys):
    _log_from_grpc_core(cygrpc.ExecuteBatchError("Failed \"execute_batch\""))
    out = capsys.readouterr().err
    assert "Traceback" not in out
    assert out.count("\n") == 1 and "level=warning" in out and "the client had gone" in out


def test_any_other_exception_logged_by_grpc_keeps_its_traceback(capsys):
    _log_from_grpc_core(RuntimeError("a real failure"))
    out = capsys.readouterr().err
    assert "level=error" in out and "Traceback" in out and "RuntimeError: a real failure" in out

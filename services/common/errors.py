"""Typed errors for bad input, and their one mapping to gRPC status codes.

Domain code raises these; the server interceptor in `server.py` turns them into
INVALID_ARGUMENT / NOT_FOUND / ... with the message, so handlers stay thin and a bad
request never crashes a service.
"""

from __future__ import annotations

import grpc


class FlywheelError(Exception):
    """Base class; `code` is the gRPC status the client sees."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(FlywheelError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(FlywheelError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(FlywheelError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(FlywheelError):
    """A well-formed request that the run's state refuses (a Commit ahead of the trainer's checkpoint)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(FlywheelError):
    code = grpc.StatusCode.UNAVAILABLE


class Undecodable(InvalidArgument):
    """The request bytes do not parse as the rpc's request message."""


class RunFailed(Exception):
    """The run as configured cannot go on (dynamic sampling found no usable groups within its budget, the data
    ran out before the last step): a restart would only fail again. `flywheel serve` exits RUN_FAILED_EXIT."""


RUN_FAILED_EXIT = 78
"""sysexits' EX_CONFIG. The local launcher stops the run at this code instead of restarting the service."""


def require(condition: bool, message: str) -> None:
    """Validate a request field: raise InvalidArgument(message) unless condition holds."""
    if not condition:
        raise InvalidArgument(message)

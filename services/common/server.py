"""The lifecycle every service shares.

    asyncio.run(run_service("replay", cfg.addresses.replay, register, main))

It starts a grpc.aio server with the standard health service, maps typed errors to
status codes in one interceptor, turns SIGINT/SIGTERM into an Event, runs the service's
`main(stop)` coroutine beside the server, then drains: NOT_SERVING, stop with grace.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import queue
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter

from services.common.config import SecurityConfig
from services.common.errors import FlywheelError, Undecodable
from services.common.logs import RateLimitedLog
from services.common.security import (client_interceptors, channel_credentials, run_token_interceptors,
                                       server_credentials)
from services.common.telemetry import ClientTraceInterceptor, ServerTraceInterceptor

log = logging.getLogger("flywheel.server")
GRACE_S = 2.0


def _message_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)  # Message.FromString is bound to its class
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return descriptor.full_name if descriptor is not None else "the request message"


def _decode(deserializer, raw: bytes, method: str, warn: RateLimitedLog):
    """The request message, or Undecodable. grpc.aio would run the deserializer before any
    interceptor can map its error, answer UNKNOWN and log at error level; so it runs here."""
    if deserializer is None:
        return raw
    try:
        return deserializer(raw)
    except Exception as err:  # DecodeError, or whatever a custom deserializer raises
        warn.warning(method, "undecodable request to %s from a client: %s", method, err)
        raise Undecodable(f"request does not decode as {_message_name(deserializer)} "
                          f"({len(raw)} bytes): {err}") from None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Undecodable requests -> INVALID_ARGUMENT; typed errors -> their status code; anything
    else -> INTERNAL, logged, server stays up. The one place errors become status codes."""

    def __init__(self) -> None:
        self.warn = RateLimitedLog(log)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler, method), request_deserializer=None,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler, method), request_deserializer=None,
                response_serializer=handler.response_serializer)
        return handler

    def _unary(self, handler, method: str):
        inner, deserializer = handler.unary_unary, handler.request_deserializer

        async def guarded(raw, context: grpc.aio.ServicerContext):
            try:
                return await inner(_decode(deserializer, raw, method, self.warn), context)
            except Exception as err:
                await _abort(err, context, method)

        return guarded

    def _stream(self, handler, method: str):
        inner, deserializer = handler.unary_stream, handler.request_deserializer
        if inspect.isasyncgenfunction(inner):
            async def guarded(raw, context: grpc.aio.ServicerContext):
                try:
                    async for reply in inner(_decode(deserializer, raw, method, self.warn), context):
                        yield reply
                except Exception as err:
                    await _abort(err, context, method)
        else:  # writes its replies with context.write (the health service's Watch)
            async def guarded(raw, context: grpc.aio.ServicerContext):
                try:
                    await inner(_decode(deserializer, raw, method, self.warn), context)
                except Exception as err:
                    await _abort(err, context, method)

        return guarded


MAX_DETAILS_BYTES = 2048
"""Longest status message sent. It travels in a trailer, percent-encoded (a non-ASCII byte takes three), and
a client drops a call whose trailers pass 8-16 KiB: a message quoting a huge request field (an environment
name of megabytes) would reach the client as RESOURCE_EXHAUSTED instead of its own code."""


def _details(message: str) -> str:
    raw = message.encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return message
    return f"{raw[:MAX_DETAILS_BYTES].decode(errors='ignore')}... ({len(raw) - MAX_DETAILS_BYTES} more bytes)"


async def _abort(err: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """Map `err` to a status and abort; re-raise what is already a status."""
    if isinstance(err, FlywheelError):
        await context.abort(err.code, _details(str(err)))
    if isinstance(err, grpc.aio.AbortError) or context.code() not in (None, grpc.StatusCode.OK):
        raise err
    log.exception("handler %s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, _details(f"{type(err).__name__}: {err}"))


Register = Callable[[grpc.aio.Server], None]
Main = Callable[[asyncio.Event], Awaitable[None]]
LOOPBACK = ("127.", "localhost:", "[::1]:")


def _size_options(security: SecurityConfig) -> list[tuple[str, int]]:
    limit = security.max_message_mb << 20
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


async def run_service(name: str, address: str, register: Register, main: Main | None = None,
                      interceptors: Sequence[grpc.aio.ServerInterceptor] = (), *,
                      security: SecurityConfig | None = None, public: Sequence[str] = ()) -> None:
    """Serve until SIGINT/SIGTERM or until `main` returns; raise if `main` fails.

    Every rpc but health checks and the `public` method prefixes needs the run token where
    `security` has one; TLS where it has a certificate. `interceptors` run after the error
    mapping and the run-token check (e.g. the controller's admin-token check on its public rpcs)."""
    security = security or SecurityConfig()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(), *run_token_interceptors(security, public), ServerTraceInterceptor(),
                      *interceptors],
        options=_size_options(security))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server)
    credentials = server_credentials(security)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"{name}: cannot bind {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(f"flywheel.v1.{name}", health_pb2.HealthCheckResponse.SERVING)
    auth = "run token" if security.run_token.get_secret_value() else "no run token"
    log.info("%s serving on %s (%s, %s)", name, address, "mTLS" if security.tls_mutual else
             "TLS" if credentials else "plaintext", auth)
    if not address.startswith(LOOPBACK) and not (credentials or security.run_token.get_secret_value()):
        log.warning("%s listens beyond loopback on %s with neither TLS nor a run token", name, address)

    freeze_startup_heap()
    work = asyncio.create_task(main(stop)) if main else None
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([t for t in (work, stopped) if t], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        await health_servicer.enter_graceful_shutdown()
        if work and not work.done():
            try:
                await asyncio.wait_for(work, GRACE_S)  # main watches `stop` and drains
            except (asyncio.TimeoutError, asyncio.CancelledError):
                work.cancel()
        await server.stop(GRACE_S)
        stopped.cancel()
    if work and work.done() and not work.cancelled() and work.exception():
        raise work.exception()


def freeze_startup_heap() -> None:
    """Take what start-up built (imports, the model, the engine) out of the cyclic garbage collector.

    A full collection walks every tracked object: with torch and transformers imported that is ~400k of
    them and ~170 ms on a 2-core machine, and Python runs one whenever enough new objects have survived,
    in the middle of a step. Frozen objects are never walked again (they are freed by reference counting
    as usual; only cycles among them would stay). What start-up left as garbage is collected first."""
    gc.collect()
    gc.freeze()


def channel(address: str, options: Sequence[tuple[str, object]] = (), *,
            security: SecurityConfig | None = None) -> grpc.aio.Channel:
    """Client channel with the servers' message-size limits, plus `options`.

    With `security` (the run's own), calls carry the run token and use TLS where configured:
    pass it for calls to the run's services, never to a third party's server (a remote environment)."""
    limits = _size_options(security or SecurityConfig())
    if security is None:
        return grpc.aio.insecure_channel(address, options=[*limits, *options],
                                         interceptors=[ClientTraceInterceptor()])
    credentials = channel_credentials(security)
    interceptors = [*client_interceptors(security), ClientTraceInterceptor()]  # traceparent: telemetry.py
    if credentials:
        return grpc.aio.secure_channel(address, credentials, options=[*limits, *options], interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=[*limits, *options], interceptors=interceptors)


RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
                     grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED})
"""Codes a long-running caller retries: the server or the run's state may change. Others (INVALID_ARGUMENT,
UNAUTHENTICATED, NOT_FOUND, ...) mean the request itself is wrong, and repeating it cannot help."""
RPC_ERRORS = Counter("flywheel_rpc_client_errors_total", "Failed rpcs a client retried, by rpc and status code.",
                     ["rpc", "code"])
_retry_log = RateLimitedLog(log)


async def retrying(call: Callable[..., Awaitable], request, *, rpc: str, stop: asyncio.Event, timeout: float,
                   max_backoff_s: float = 2.0):
    """`await call(request)` until it succeeds; None once `stop` is set. A RETRIED error is counted
    (RPC_ERRORS), logged at most every 10 s, and retried after a capped exponential back-off, so no
    refusal or restart on the server's side ends the caller; any other error is raised."""
    backoff = 0.05
    while not stop.is_set():
        try:
            return await call(request, timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRIED:
                raise
            RPC_ERRORS.labels(rpc, err.code().name).inc()
            _retry_log.warning(rpc, "%s failed, retrying: %s %s", rpc, err.code().name, err.details())
        try:
            await asyncio.wait_for(stop.wait(), backoff)
        except asyncio.TimeoutError:
            pass
        backoff = min(2 * backoff, max_backoff_s)
    return None


def in_daemon_thread(fn, *args, **kwargs) -> asyncio.Future:
    """Run a blocking call (a collective, a training step) off the event loop, on a new thread.

    Unlike asyncio.to_thread, the thread is a daemon: a service told to stop exits at once
    instead of waiting, at interpreter shutdown, for a collective stuck on a dead peer.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    threading.Thread(target=_settle, args=(loop, future, fn, args, kwargs), daemon=True).start()
    return future


class SerialThread:
    """One daemon thread that runs blocking calls one at a time, in the order they were made.

    For a caller that makes many calls a second (an engine's generate calls): starting a thread
    per call (in_daemon_thread) blocks the event loop in Thread.start until the new thread runs,
    and on a busy host that is a scheduler time slice per call.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn, *args, **kwargs) -> asyncio.Future:
        """Queue `fn(*args, **kwargs)`; the future settles with its result or exception."""
        if self._closed:  # nothing would ever run it: the caller would wait for ever
            raise RuntimeError(f"{self._thread.name}: closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args, kwargs))
        return future

    def close(self) -> None:
        """Calls already queued still run; the thread ends after them."""
        self._closed = True
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            _settle(*item)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn, args, kwargs) -> None:
    """Run fn in this thread and settle `future` with the outcome on its loop."""
    try:
        result = fn(*args, **kwargs)
    except BaseException as err:  # handed to the awaiting coroutine
        outcome = (future.set_exception, err)
    else:
        outcome = (future.set_result, result)

    def settle(setter, value) -> None:
        if not future.done():  # the caller may have been cancelled meanwhile
            setter(value)

    try:
        loop.call_soon_threadsafe(settle, *outcome)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass

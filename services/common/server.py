"""The lifecycle every service shares.

    asyncio.run(run_service("replay", cfg.addresses.replay, register, main))

It starts a grpc.aio server with the standard health service, maps typed errors to
status codes in one interceptor, turns SIGINT/SIGTERM into an Event, runs the service's
`main(stop)` coroutine beside the server, then drains: NOT_SERVING, stop with grace.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import FlywheelError

log = logging.getLogger("flywheel.server")
GRACE_S = 2.0


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Typed errors -> their status code; anything else -> INTERNAL, logged, server stays up."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def guarded(request, context: grpc.aio.ServicerContext):
            try:
                return await inner(request, context)
            except FlywheelError as err:
                await context.abort(err.code, str(err))
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if isinstance(err, grpc.aio.AbortError) or context.code() not in (None, grpc.StatusCode.OK):
                    raise
                log.exception("handler %s failed", handler_call_details.method)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


Register = Callable[[grpc.aio.Server], None]
Main = Callable[[asyncio.Event], Awaitable[None]]


async def run_service(name: str, address: str, register: Register, main: Main | None = None,
                      interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
    """Serve until SIGINT/SIGTERM or until `main` returns; raise if `main` fails.

    `interceptors` run after the error mapping (e.g. the controller's auth check)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    server = grpc.aio.server(interceptors=[ErrorInterceptor(), *interceptors],
                             options=[("grpc.max_receive_message_length", 256 << 20),
                                      ("grpc.max_send_message_length", 256 << 20)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    register(server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"{name}: cannot bind {address}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(f"flywheel.v1.{name}", health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving on %s", name, address)

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


def channel(address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """Client channel with the same message-size limits as the servers, plus `options`."""
    return grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20),
                                                       ("grpc.max_send_message_length", 256 << 20), *options])


def in_daemon_thread(fn, *args, **kwargs) -> asyncio.Future:
    """Run a blocking call (a collective, a training step) off the event loop.

    Unlike asyncio.to_thread, the thread is a daemon: a service told to stop exits at once
    instead of waiting, at interpreter shutdown, for a collective stuck on a dead peer.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def target() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:  # handed to the awaiting coroutine
            outcome = (future.set_exception, err)
        else:
            outcome = (future.set_result, result)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    threading.Thread(target=target, daemon=True).start()
    return future

"""Who may call a flywheel gRPC server, and how a client proves it: tokens and TLS in one place.

One token check serves two tokens:
- the run token, on every rpc of every service except health checks and the controller's admin
  API: metadata `flywheel-run-token: <token>`. `flywheel up` makes one per run; clients built by
  `server.channel(address, security=...)` attach it.
- the controller's admin token, on ControllerService rpcs: `authorization: Bearer <token>`
  (services/controller/auth.py).
A call without the token, or with another one, is answered UNAUTHENTICATED before its request is
decoded, and logged at most every 10 s per rpc. Tokens are compared in constant time, never logged.

TLS (server certificate, CA) and mTLS (client certificates too) come from `SecurityConfig`.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from pydantic import SecretStr

from services.common.config import SECRET_ENV, SecurityConfig
from services.common.logs import RateLimitedLog

log = logging.getLogger("flywheel.security")
RUN_TOKEN_KEY = "flywheel-run-token"
HEALTH_PREFIX = "/grpc.health.v1.Health/"

Metadata = Sequence[tuple[str, str | bytes]] | None


def metadata_value(metadata: Metadata, key: str) -> str | None:
    """The stripped value of the first `key` entry (case-insensitive); None when absent or blank."""
    for k, value in metadata or ():
        if k.lower() == key:
            value = (value.decode(errors="replace") if isinstance(value, bytes) else value).strip()
            return value or None
    return None


def bearer_token(metadata: Metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` entry; None when there is none."""
    scheme, _, token = (metadata_value(metadata, "authorization") or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def run_token(metadata: Metadata) -> str | None:
    return metadata_value(metadata, RUN_TOKEN_KEY)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to protected rpcs whose token (as `read` finds it) is not `token`."""

    def __init__(self, token: str, *, read: Callable[[Metadata], str | None], protects: Callable[[str], bool],
                 what: str, how: str) -> None:
        if not token:
            raise ValueError(f"{type(self).__name__} needs a non-empty token")
        self._token = token.encode()
        self.read, self.protects, self.what, self.how = read, protects, what, how
        self.warn = RateLimitedLog(log)

    def allows(self, metadata: Metadata) -> bool:
        given = self.read(metadata)
        return given is not None and hmac.compare_digest(given.encode(), self._token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method, metadata = handler_call_details.method, handler_call_details.invocation_metadata
        if handler is None or not self.protects(method) or self.allows(metadata):
            return handler
        message = f"{'missing' if self.read(metadata) is None else 'invalid'} {self.what}: {self.how}"
        self.warn.warning(method, "refused %s: %s", method, message)

        async def reject(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        # No deserializer: an unauthenticated request is refused without being decoded.
        if handler.unary_stream is not None:
            async def reject_stream(request, context: grpc.aio.ServicerContext):
                await reject(request, context)
            return grpc.unary_stream_rpc_method_handler(reject_stream,
                                                        response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(reject, response_serializer=handler.response_serializer)


def run_token_interceptors(security: SecurityConfig, public: Sequence[str] = ()) -> list[grpc.aio.ServerInterceptor]:
    """The run-token check for every rpc but health checks and `public` method prefixes; none without a token."""
    token = security.run_token.get_secret_value()
    if not token:
        return []
    open_prefixes = (HEALTH_PREFIX, *public)
    return [TokenAuthInterceptor(token, read=run_token, protects=lambda m: not m.startswith(open_prefixes),
                                 what="run token", how=f"internal rpcs need metadata '{RUN_TOKEN_KEY}' "
                                                       "(security.run_token or FLYWHEEL_RUN_TOKEN)")]


class AttachMetadata(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Client side: adds fixed metadata (the run token) to every call of a channel."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        self.entries = tuple(entries)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.entries)
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def client_interceptors(security: SecurityConfig) -> list[grpc.aio.ClientInterceptor]:
    token = security.run_token.get_secret_value()
    return [AttachMetadata([(RUN_TOKEN_KEY, token)])] if token else []


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS for servers where a certificate is configured (client certificates required under tls_mutual)."""
    if not security.tls_cert:
        return None
    return grpc.ssl_server_credentials([(_read(security.tls_key), _read(security.tls_cert))],
                                       root_certificates=_read(security.tls_ca),
                                       require_client_auth=security.tls_mutual)


def channel_credentials(security: SecurityConfig) -> grpc.ChannelCredentials | None:
    """TLS for clients where a CA is configured; they present tls_cert too under tls_mutual."""
    if not security.tls_ca:
        return None
    if security.tls_mutual:
        return grpc.ssl_channel_credentials(_read(security.tls_ca), _read(security.tls_key), _read(security.tls_cert))
    return grpc.ssl_channel_credentials(_read(security.tls_ca))


def with_local_credentials(security: SecurityConfig) -> SecurityConfig:
    """`security` with fresh random credentials where it has none: the run token, a NATS token and a Redis
    password (what `flywheel up` runs with; it starts NATS and Redis with the same ones)."""
    fresh = {key: SecretStr(secrets.token_urlsafe(32)) for key in ("run_token", "nats_token", "redis_password")
             if not getattr(security, key).get_secret_value()}
    if security.nats_user:
        fresh.pop("nats_token", None)  # user and password configured: keep them, no token on top
    return security.model_copy(update=fresh)


def secret_env(security: SecurityConfig) -> dict[str, str]:
    """The credentials as the environment variables SecurityConfig reads: how a launcher hands them to
    child processes without writing them into the config file or onto a command line."""
    out = {}
    for key, var in SECRET_ENV.items():
        value = getattr(security, key)
        value = value.get_secret_value() if isinstance(value, SecretStr) else value
        if value:
            out[var] = value
    return out

"""Bearer-token auth for the controller's admin API, as one grpc.aio server interceptor.

Where `controller.auth_token` is set, every ControllerService rpc must carry the metadata
`authorization: Bearer <token>`; anything else is answered UNAUTHENTICATED before the
handler runs. Health checks stay open, so probes and launchers need no token.
"""

from __future__ import annotations

import hmac

import grpc

ADMIN_PREFIX = "/flywheel.v1.ControllerService/"


def bearer_token(metadata) -> str | None:
    """The token of an `authorization: Bearer <token>` entry; None when there is none."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            scheme, _, token = (value.decode() if isinstance(value, bytes) else value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects admin rpcs whose bearer token is missing or differs from `token` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("BearerAuthInterceptor needs a non-empty token")
        self._token = token.encode()

    def allows(self, metadata) -> bool:
        given = bearer_token(metadata)
        return given is not None and hmac.compare_digest(given.encode(), self._token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(ADMIN_PREFIX)
                or self.allows(handler_call_details.invocation_metadata)):
            return handler
        message = "missing bearer token" if bearer_token(handler_call_details.invocation_metadata) is None \
            else "invalid bearer token"

        async def reject(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{message}: send metadata 'authorization: Bearer <controller.auth_token>'")

        return grpc.unary_unary_rpc_method_handler(reject, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """The controller's extra interceptors: auth when a token is configured, none otherwise."""
    return [BearerAuthInterceptor(token)] if token else []

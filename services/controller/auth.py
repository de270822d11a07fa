"""Bearer-token auth for the controller's admin API: the shared token check (common/security.py)
applied to ControllerService rpcs.

Where `controller.auth_token` is set, every ControllerService rpc must carry the metadata
`authorization: Bearer <token>`; anything else is answered UNAUTHENTICATED before the
handler runs. Health checks stay open, so probes and launchers need no token. The admin API
is the run's public face, so the run token (internal rpcs only) is not asked of it: `PUBLIC`.
"""

from __future__ import annotations

import grpc

from services.common.security import TokenAuthInterceptor, bearer_token

ADMIN_PREFIX = "/flywheel.v1.ControllerService/"
PUBLIC = (ADMIN_PREFIX,)
"""Method prefixes exempt from the run token (run_service's `public`)."""

__all__ = ["ADMIN_PREFIX", "PUBLIC", "BearerAuthInterceptor", "bearer_token", "interceptors"]


class BearerAuthInterceptor(TokenAuthInterceptor):
    """Rejects admin rpcs whose bearer token is missing or differs from `token` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        super().__init__(token, read=bearer_token, protects=lambda method: method.startswith(ADMIN_PREFIX),
                         what="bearer token", how="send metadata 'authorization: Bearer <controller.auth_token>'")


def interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """The controller's extra interceptors: auth when a token is configured, none otherwise."""
    return [BearerAuthInterceptor(token)] if token else []

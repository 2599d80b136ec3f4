"""Optional bearer-token auth: ``authorization: Bearer <token>`` on every call."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

__all__ = ["TokenAuthInterceptor", "OPEN_METHODS_PREFIXES"]

# Probes and grpcurl discovery stay open: they reveal nothing a token protects.
OPEN_METHODS_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _deny(message: str) -> grpc.RpcMethodHandler:
    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_METHODS_PREFIXES):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got_bytes = got.encode() if isinstance(got, str) else bytes(got)
        if not hmac.compare_digest(got_bytes, self._expected):
            return _deny("missing or wrong bearer token (metadata 'authorization: Bearer <token>')")
        return await continuation(details)

"""Optional bearer-token auth: ``authorization: Bearer <token>`` on every call.

A refused call is written as one audit line (logger ``eplb_service.audit``) with its method and
peer, never the token it carried.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc

__all__ = ["OPEN_METHODS_PREFIXES", "TokenAuthInterceptor"]

audit = logging.getLogger("eplb_service.audit")

# Probes and grpcurl discovery stay open: they reveal nothing a token protects.
OPEN_METHODS_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_MESSAGE = "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"


def _deny(method: str) -> grpc.RpcMethodHandler:
    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        audit.warning(
            "audit: auth failure on %s from %s",
            method,
            context.peer(),
            extra={"audit": "auth_failure", "method": method, "peer": context.peer()},
        )
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    return grpc.unary_unary_rpc_method_handler(abort)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = token.encode()
        # One refusal handler per existing method: the set stays as small as the service.
        self._deny: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_METHODS_PREFIXES):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got_bytes = got.encode() if isinstance(got, str) else bytes(got)
        # The scheme is case-insensitive (RFC 7235: "bearer" is "Bearer"); the token is not.
        scheme, _, credentials = got_bytes.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # no such method: UNIMPLEMENTED, as without auth
            return None
        deny = self._deny.get(details.method)
        if deny is None:
            deny = self._deny[details.method] = _deny(details.method)
        return deny

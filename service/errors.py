"""Service errors and their one mapping onto gRPC statuses (rich ``google.rpc`` details).

Library code raises the exceptions below; :class:`ErrorInterceptor` turns them, and any
``ValueError`` from the core, into statuses, so servicers never build a status themselves.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = [
    "ServiceError",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "StoreUnavailable",
    "Aborted",
    "ErrorInterceptor",
    "to_status",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FieldViolation:
    """One bad field: its path in the request (e.g. ``logical.shape``) and what is allowed."""

    field: str
    description: str


class ServiceError(Exception):
    """Base class: ``code`` is the gRPC status code the error maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: list[FieldViolation] | FieldViolation) -> None:
        self.violations = [violations] if isinstance(violations, FieldViolation) else list(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StoreUnavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(ServiceError):
    """A concurrent change won (e.g. another replica published first); retrying is safe."""

    code = grpc.StatusCode.ABORTED


def to_status(exc: BaseException) -> status_pb2.Status | None:
    """The rich status for ``exc``, or None when it is not ours to map (a bug: INTERNAL)."""
    if isinstance(exc, InvalidArgument):
        violations = exc.violations
    elif isinstance(exc, ValueError):
        # The core validates its inputs and raises ValueError naming the field and the rule.
        violations = [FieldViolation("request", str(exc))]
        exc = InvalidArgument(violations)
    elif isinstance(exc, ServiceError):
        return status_pb2.Status(code=exc.code.value[0], message=str(exc))
    else:
        return None
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in violations
            ]
        )
    )
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(exc), details=[detail])


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    status = to_status(exc)
    if status is None:
        log.exception("unhandled error in %s", getattr(context, "_method", "rpc"), exc_info=exc)
        status = status_pb2.Status(code=code_pb2.INTERNAL, message=f"internal error: {type(exc).__name__}")
    await context.abort_with_status(rpc_status.to_status(status))


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def call(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request_or_iterator, context)
        except (ServiceError, ValueError) as exc:
            await _abort(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001  (mapped to INTERNAL and logged once, here)
            await _abort(context, exc)

    return call


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except (ServiceError, ValueError) as exc:
            await _abort(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

    return call


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by any handler to statuses, in one place."""

    def __init__(self) -> None:
        # Wrapped handlers per method: building them on every call costs as much as a small RPC.
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None:
            cached = self._wrapped[method] = self._wrap(handler)
        return cached

    @staticmethod
    def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kw = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream), **kw)
        return handler

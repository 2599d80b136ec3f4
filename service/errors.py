"""Service errors and their one mapping onto gRPC statuses (rich ``google.rpc`` details).

Library code raises the exceptions below; ``to_status`` is the one map from an exception (and
any ``ValueError`` from the core, or ``WireError`` of the wire's codecs) to a status, so
servicers never build a status themselves. The interceptor that applies it to every call is
``calls.py``'s ``ErrorInterceptor``.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from eplb import PolicyError
from eplb_wire.errors import READS_ONLY, REASON_KEY, WireError

from .clip import MAX_DESCRIPTION, MAX_FIELD, MAX_MESSAGE, MAX_VIOLATIONS, cap

__all__ = [
    "Aborted",
    "AlreadyExists",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "ServiceError",
    "ShuttingDown",
    "StoreUnavailable",
    "Unauthenticated",
    "PUSHBACK_KEY",
    "abort_status",
    "to_status",
]

log = logging.getLogger(__name__)
audit = logging.getLogger("eplb_service.audit")


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
    """A concurrent change won (e.g. another instance published first); retrying is safe."""

    code = grpc.StatusCode.ABORTED


class ResourceExhausted(ServiceError):
    """A documented limit (docs/service.md, "Limits") or a bounded queue is full. ``retry_after_s``:
    a full queue that drains says when to come back (``grpc-retry-pushback-ms``, gRPC's retry
    hint, which eplb's engine client waits for); a limit that stays says nothing, and clients do
    not repeat the call."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# gRPC's retry hint (A6): the client waits this many milliseconds before another attempt.
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    """A status to abort with (grpc.Status is an interface): the rich status's, plus the hint."""


class OutOfRange(ServiceError):
    code = grpc.StatusCode.OUT_OF_RANGE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(ServiceError):
    """A known token outside its role or deployments (auth.py)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(ServiceError):
    """No valid token: missing, unknown, or revoked by a reload of the auth file (auth.py)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class ReadsOnly(ServiceError):
    """This instance takes no reports (``--reads-only``): the client should report to another."""

    code = grpc.StatusCode.UNAVAILABLE


class ShuttingDown(ServiceError):
    """This instance is stopping: the client should call another instance (resending what it must)."""

    code = grpc.StatusCode.UNAVAILABLE


def _bounded(violations: list[FieldViolation]) -> list[FieldViolation]:
    """At most ``MAX_VIOLATIONS`` violations, each field and description capped (clip.py):
    whatever a handler echoed of the request, the status fits gRPC's trailers."""
    kept = [FieldViolation(cap(v.field, MAX_FIELD), cap(v.description, MAX_DESCRIPTION)) for v in violations]
    if len(kept) > MAX_VIOLATIONS:
        # The last stays: a report stream's progress note ("the reports before it were kept").
        more = len(kept) - MAX_VIOLATIONS + 1
        kept = [*kept[: MAX_VIOLATIONS - 2], FieldViolation("request", f"{more} more violations not shown"), kept[-1]]
    return kept


def to_status(exc: BaseException) -> status_pb2.Status | None:
    """The rich status for ``exc``, or None when it is not ours to map (a bug: INTERNAL). Its
    message and details are bounded (clip.py), whatever the exception echoed."""
    if isinstance(exc, InvalidArgument):
        violations = exc.violations
    elif isinstance(exc, WireError):
        # A bad Array or Topology (eplb_wire's codecs): its field paths and rules, as field violations.
        violations = [FieldViolation(field, description) for field, description in exc.violations]
        exc = InvalidArgument(violations)
    elif isinstance(exc, PolicyError):
        # A plugin policy's bad output is this server's fault, not the request's.
        return status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=cap(str(exc), MAX_MESSAGE))
    elif isinstance(exc, ValueError):
        # The core validates its inputs and raises ValueError naming the field and the rule.
        violations = [FieldViolation("request", str(exc))]
        exc = InvalidArgument(violations)
    elif isinstance(exc, ServiceError):
        return status_pb2.Status(code=exc.code.value[0], message=cap(str(exc), MAX_MESSAGE))
    else:
        return None
    violations = _bounded(violations)
    detail = any_pb2.Any()
    detail.Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in violations
            ]
        )
    )
    message = cap(str(InvalidArgument(violations)), MAX_MESSAGE)
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=message, details=[detail])


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def abort_status(exc: BaseException) -> tuple[grpc.Status, bool]:
    """The status to abort a call that raised ``exc`` with, and whether ``exc`` was ours to map
    (False: a bug, ``INTERNAL`` naming only its type). A ``ResourceExhausted`` with
    ``retry_after_s`` carries gRPC's retry hint (``PUSHBACK_KEY``) in its trailing metadata."""
    status = to_status(exc)
    ours = status is not None
    if status is None:
        status = status_pb2.Status(code=code_pb2.INTERNAL, message=f"internal error: {type(exc).__name__}")
    out = rpc_status.to_status(status)
    if isinstance(exc, ReadsOnly):
        out = _Status(out.code, out.details, tuple(out.trailing_metadata) + ((REASON_KEY, READS_ONLY),))
    after = getattr(exc, "retry_after_s", None)
    if isinstance(exc, ResourceExhausted) and after is not None:
        hint = ((PUSHBACK_KEY, str(max(1, round(after * 1000)))),)
        out = _Status(out.code, out.details, tuple(out.trailing_metadata) + hint)
    return out, ours

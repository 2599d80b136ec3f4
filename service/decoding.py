"""Request messages whose bytes do not parse: the interceptor's deserializer hands the handler an
:class:`Undecodable` in their place (:func:`decoding`), and :class:`BadMessages` turns one into
INVALID_ARGUMENT, with at most one log line a minute per method (logger ``eplb_service.errors``).
Without this grpc would log a traceback and answer UNKNOWN."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from .clip import cap
from .errors import FieldViolation, InvalidArgument
from .log_throttle import LogThrottle

__all__ = ["BadMessages", "Undecodable", "decoding"]

# The logger name operators filter by stays that of before the interceptor had its own module.
log = logging.getLogger("eplb_service.errors")


@dataclass(frozen=True)
class Undecodable:
    """A request message whose bytes did not parse (what the interceptor's deserializer hands
    the handler instead of raising: grpc would log a traceback and answer UNKNOWN)."""

    message_type: str
    size: int
    error: str


def decoding(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, returning :class:`Undecodable` for bytes it cannot parse."""
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    message_type = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "the request message")

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001  (protobuf's DecodeError, or another deserializer's error)
            return Undecodable(message_type, len(data), cap(f"{type(exc).__name__}: {exc}", 200))

    return decode


class BadMessages:
    """The statuses for undecodable messages, and their log lines: throttled (``throttle``, shared
    with the audit lines), as any caller could otherwise write one a call."""

    def __init__(self, throttle: LogThrottle | None = None) -> None:
        self._throttle = throttle if throttle is not None else LogThrottle()

    def refuse(self, label: str, request: Undecodable, context: grpc.aio.ServicerContext) -> InvalidArgument:
        """The status for a message that did not parse; one log line a minute per method."""
        held = self._throttle.admit((label, "undecodable"))
        if held is not None:
            log.warning(
                "%s: a message of %d bytes from %s is not a valid %s (%s)%s",
                label,
                request.size,
                context.peer(),
                request.message_type,
                request.error,
                f"; {held} more in the last minute" if held else "",
            )
        return InvalidArgument(
            FieldViolation("request", f"{request.size} bytes that do not parse as {request.message_type}")
        )

    def refuse_in_stream(
        self, label: str, request: Undecodable, context: grpc.aio.ServicerContext, processed: int
    ) -> InvalidArgument:
        """The status for message ``processed`` of a client stream (those before it were processed)."""
        exc = self.refuse(label, request, context)
        return InvalidArgument(
            [
                FieldViolation(f"message {processed}", exc.violations[0].description),
                FieldViolation("stream", f"the {processed} messages before it were processed; resend from it on"),
            ]
        )

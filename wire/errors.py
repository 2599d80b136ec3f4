"""The error of a message that breaks the wire contract, with the field paths it breaks, and the
reasons a refusal names in its trailing metadata for clients to act on."""

from __future__ import annotations

__all__ = ["WireError", "REASON_KEY", "READS_ONLY", "reason"]

REASON_KEY = "eplb-reason"
"""Trailing-metadata key of a refusal's machine-readable reason (a status's text is for people)."""

READS_ONLY = "reads-only"
"""``REASON_KEY``'s value when a reads-only instance (``eplb serve --reads-only``) refuses a report
with ``UNAVAILABLE``: the caller listed it among the addresses its reports go to."""


def reason(error: object) -> str:
    """A failed call's ``REASON_KEY`` value (a ``grpc.RpcError`` or ``grpc.aio.AioRpcError``), ""
    when it names none (refusals of 1.0.0 instances name none)."""
    try:
        metadata = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a call's error, or one without metadata
        return ""
    for key, value in metadata:
        if key == REASON_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


class WireError(ValueError):
    """A bad message: ``violations`` are (field path, what is wrong and what is allowed) pairs,
    ``field`` and ``description`` the first's. The service maps it to ``INVALID_ARGUMENT`` with
    those field violations; the engine side lets it through as a ``ValueError``."""

    def __init__(self, field: str, description: str, *more: tuple[str, str]) -> None:
        self.field, self.description = field, description
        self.violations: tuple[tuple[str, str], ...] = ((field, description), *more)
        super().__init__("; ".join(f"{f}: {d}" for f, d in self.violations))

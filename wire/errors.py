"""The error of a message that breaks the wire contract, with the field paths it breaks."""

from __future__ import annotations

__all__ = ["WireError"]


class WireError(ValueError):
    """A bad message: ``violations`` are (field path, what is wrong and what is allowed) pairs,
    ``field`` and ``description`` the first's. The service maps it to ``INVALID_ARGUMENT`` with
    those field violations; the engine side lets it through as a ``ValueError``."""

    def __init__(self, field: str, description: str, *more: tuple[str, str]) -> None:
        self.field, self.description = field, description
        self.violations: tuple[tuple[str, str], ...] = ((field, description), *more)
        super().__init__("; ".join(f"{f}: {d}" for f, d in self.violations))

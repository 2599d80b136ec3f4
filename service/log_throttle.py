"""``LogThrottle``: at most one log line per key a minute, for lines any caller could otherwise
have written once a call (undecodable messages, refused deployment changes, failed acks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["LogThrottle"]


class LogThrottle:
    """At most one log line per key per ``window_s``: :meth:`admit` says whether to write one
    now and how many it held back since the last. At most ``max_keys`` keys are tracked; more
    share the key ``"other"``, so callers choosing keys cannot grow it."""

    def __init__(self, window_s: float = 60.0, max_keys: int = 256, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._last: dict[Any, list] = {}  # key -> [time of the last line, held back since]

    def admit(self, key: Any) -> int | None:
        """None: hold this line back (counted); else write it, with this many held back before it."""
        now = self._clock()
        if key not in self._last and len(self._last) >= self.max_keys:
            key = "other"
        entry = self._last.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return None
        held = 0 if entry is None else entry[1]
        self._last[key] = [now, 0]
        return held

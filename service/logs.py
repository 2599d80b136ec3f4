"""Logging set-up for ``eplb serve``: plain text (default) or one JSON object per line.

JSON lines carry ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, any ``extra=`` fields the
call passed (e.g. ``audit``, ``deployment``, ``peer``, ``code``) and, for an unexpected error,
its traceback as one string field ``exc``, so a line is always one record.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

__all__ = ["LOG_FORMATS", "PLAIN_FORMAT", "JsonFormatter", "setup_logging"]

LOG_FORMATS = ("plain", "json")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: Literal["plain", "json"] = "plain") -> None:
    """Configures the root logger to write ``fmt`` records at ``level`` and above to stderr."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(PLAIN_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)

"""Client strings cut to a bounded size before they reach a log line or a status.

Anything a caller sends (a deployment name, a policy, an error text) may be megabytes long.
Echoed whole, it fills the disk through the log (one 1 MiB name a call) and breaks the status
that carries it: gRPC refuses trailers over its metadata limit (8 KiB by default), so the
caller gets a transport ``RESOURCE_EXHAUSTED`` instead of the reason. :func:`clip` keeps a
string's head, its length and a short hash (two long names still tell apart in a log);
:func:`cap` bounds a whole message or field description, the net under every status.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["MAX_DESCRIPTION", "MAX_FIELD", "MAX_MESSAGE", "MAX_VIOLATIONS", "cap", "clip", "plain"]

# Status bounds (docs/service.md, "Limits"). A status travels in the trailers twice: the
# message as ``grpc-message`` and the details (field violations) base64'd in
# ``grpc-status-details-bin``; gRPC clients refuse trailers past 8 KiB (soft) to 16 KiB (hard).
# 1 KiB of message and 8 violations of 96 + 256 characters come to under 5 KiB in all.
MAX_MESSAGE = 1024
MAX_DESCRIPTION = 256
MAX_FIELD = 96
MAX_VIOLATIONS = 8


_PLAIN = re.compile(r"[A-Za-z0-9._-]{1,64}")


def clip(value: str | bytes, limit: int = 64) -> str:
    """``value`` quoted as ``ascii`` does, or, when that is longer than ``limit`` characters
    between its quotes, its first ``limit`` quoted, then its length and a short SHA-256:
    ``'aaaa'... (1048576 characters, sha256 3f1c0b2a9e8d)``. Always printable ASCII (a status
    message is percent-encoded on the wire, a log line stays one line), and at most ``limit``
    + 60 characters however the value escapes (an emoji is 10 of them)."""
    shown = ascii(value[:limit])
    if len(value) <= limit and len(shown) <= limit + 3:  # (b'' adds one)
        return shown
    if len(shown) > limit + 3:
        shown = shown[: limit + 1] + shown[-1]  # cut within the quotes, which close it again
    data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value
    unit = "characters" if isinstance(value, str) else "bytes"
    return f"{shown}... ({len(value)} {unit}, sha256 {hashlib.sha256(data).hexdigest()[:12]})"


def plain(value: str) -> bool:
    """Whether ``value`` may go into a structured log field as it is: 1-64 of ``A-Z a-z 0-9 .
    _ -`` (a deployment name's characters; anything else goes clipped)."""
    return _PLAIN.fullmatch(value) is not None


def cap(text: str, limit: int) -> str:
    """``text`` itself, or its first ``limit`` characters and how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"

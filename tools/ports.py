"""A free loopback port, for the processes a tool starts (``eplb demo``'s gloo group), and the
servers and process groups of the benchmarks and tests (the one copy they all import)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

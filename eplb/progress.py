"""Progress of a plan: ``rebalance(..., progress=callback)`` calls ``callback(Progress(...))``
as layers finish, at most once per chunk of layers (never per inner step), from the thread
that called ``rebalance``.

The policies report through ``report`` below, which finds the callback of the ``rebalance``
call that runs them in a context variable: the policy signature stays ``fn(loads, topology,
options)``, a plugin policy may report too, and concurrent plans (the service's threads) each
see their own. Reporting changes no placement: it only reads counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["Progress", "report", "reporting"]


@dataclass(frozen=True)
class Progress:
    """Where a plan stands: ``done_rows`` of ``total_rows`` layers through ``phase`` (``"first
    plan"``, ``"search"``, ``"re-plan"``, ``"ilp"``, ...; a plan may run several phases, each
    counting its layers from 0), ``elapsed_s`` seconds since ``rebalance`` began."""

    done_rows: int
    total_rows: int
    phase: str
    elapsed_s: float


@dataclass(frozen=True)
class _Reporter:
    callback: Callable[[Progress], object]
    start: float


_CURRENT: ContextVar[_Reporter | None] = ContextVar("eplb_progress", default=None)


def check_callback(progress: object) -> None:
    """``ValueError`` naming ``progress`` unless it is ``None`` or callable."""
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be a callable taking an eplb.Progress, or None; got {progress!r}")


@contextmanager
def reporting(progress: Callable[[Progress], object] | None) -> Iterator[None]:
    """Within it, ``report`` calls ``progress`` (``None``: the enclosing plan's, if any)."""
    if progress is None:
        yield
        return
    token = _CURRENT.set(_Reporter(progress, time.perf_counter()))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def report(phase: str, done: int, total: int) -> None:
    """Tell the running plan's callback (if any) that ``done`` of ``total`` layers are through
    ``phase``. Cheap without a callback: one context-variable read."""
    reporter = _CURRENT.get()
    if reporter is not None:
        reporter.callback(Progress(int(done), int(total), phase, time.perf_counter() - reporter.start))

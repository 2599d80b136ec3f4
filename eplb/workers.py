"""The process pool that plans layers in parallel (the ``workers=`` option)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from multiprocessing import get_context

__all__ = ["worker_pool"]


@lru_cache(maxsize=4)
def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes, kept for the next plan, whose start would otherwise cost
    more than a plan. forkserver: safe when the caller runs threads (a gRPC server)."""
    return ProcessPoolExecutor(workers, mp_context=get_context("forkserver"))

"""The process pool that plans layers in parallel (the ``workers=`` option)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

__all__ = ["worker_pool", "shutdown_pools"]

# One pool per size, kept for the next plan: starting one costs more than a plan.
_POOLS: dict[int, ProcessPoolExecutor] = {}


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes, kept for the next plan, whose start would otherwise cost
    more than a plan. forkserver: safe when the caller runs threads (a gRPC server)."""
    if workers not in _POOLS:
        _POOLS[workers] = ProcessPoolExecutor(workers, mp_context=get_context("forkserver"))
    return _POOLS[workers]


def shutdown_pools() -> None:
    """Stops every pool ``worker_pool`` made; its processes exit. A process that leaves its
    ``multiprocessing`` entry point must call it first: the pools' workers are not daemons, and
    that exit joins them before the pools' own exit hook would stop them (it waits forever)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown(wait=True, cancel_futures=True)

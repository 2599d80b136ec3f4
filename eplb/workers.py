"""The process pool that plans layers in parallel (the ``workers=`` option)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import current_process, get_context
from typing import Any

__all__ = ["worker_pool", "shutdown_pools"]

# What a caller whose workers died is told: the usual cause is a script without the guard,
# whose every worker re-runs it on start (forkserver imports the main module afresh).
_GUARD_HINT = (
    'a script that calls rebalance(..., workers=k) must do it under `if __name__ == "__main__":` '
    "(each worker process imports the main script again; docs/algorithms.md, Layers in parallel)"
)


class _Pool(ProcessPoolExecutor):
    """A ``ProcessPoolExecutor`` whose ``map`` turns a broken pool (a worker that died, most
    often one re-running an unguarded script) into a ``ValueError`` that names the fix, and
    drops the broken pool so the next plan starts a fresh one."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, mp_context=get_context("forkserver"))
        self._eplb_workers = workers

    def map(
        self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float | None = None, chunksize: int = 1
    ) -> Iterator[Any]:
        try:
            results = super().map(fn, *iterables, timeout=timeout, chunksize=chunksize)
        except BrokenProcessPool as exc:
            raise self._guard_error(exc) from None
        return self._results(results)

    def _results(self, results: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from results
        except BrokenProcessPool as exc:
            raise self._guard_error(exc) from None

    def _guard_error(self, exc: BrokenProcessPool) -> ValueError:
        if _POOLS.get(self._eplb_workers) is self:
            del _POOLS[self._eplb_workers]
        # Its workers are gone; shutting it down releases its semaphores (else the
        # resource tracker warns about leaked ones at exit).
        self.shutdown(wait=True, cancel_futures=True)
        return ValueError(f"workers={self._eplb_workers}: a planning worker process exited ({exc}); {_GUARD_HINT}")


# One pool per size, kept for the next plan: starting one costs more than a plan.
_POOLS: dict[int, _Pool] = {}


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes, kept for the next plan, whose start would otherwise cost
    more than a plan. forkserver: safe when the caller runs threads (a gRPC server)."""
    if getattr(current_process(), "_inheriting", False):
        # This is a pool worker importing the caller's unguarded main script, which has come
        # to its rebalance(workers=k) call. Starting a pool here cannot work (multiprocessing
        # raises RuntimeError), and running on would repeat the script's work in every worker:
        # stop this process quietly; the caller's map raises the ValueError that names the fix.
        raise SystemExit(f"eplb: {_GUARD_HINT}")
    if workers not in _POOLS:
        _POOLS[workers] = _Pool(workers)
    return _POOLS[workers]


def shutdown_pools() -> None:
    """Stops every pool ``worker_pool`` made; its processes exit. A process that leaves its
    ``multiprocessing`` entry point must call it first: the pools' workers are not daemons, and
    that exit joins them before the pools' own exit hook would stop them (it waits forever)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown(wait=True, cancel_futures=True)

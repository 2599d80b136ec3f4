"""Where plans run: small pools of worker processes, so the event loop only serves.

A plan holds the GIL for milliseconds to seconds; run in the server's process it stalls every
call the replica serves (GetPlacement p99 rose from 1.8 ms to 34 ms with re-plans running).
Each job travels to a worker as arrays (loads ``[L, E]``, the previous ``phy2log [L, P]``) and
comes back as ``phy2log``, ``logcnt`` and the serialized ``PlanStats``.

Two pools: one for the re-plans of deployments (Rebalance and the trigger loop) and one for
stateless ComputePlacement calls, which is bounded (``limits.COMPUTE_*``) and refuses calls
beyond its queue with RESOURCE_EXHAUSTED, so remote callers can never take the capacity that
triggered re-plans need. A stateless call's worker is killed when the call's deadline passes.
Workers are spawned (never forked from a process running gRPC) on first use, shared by every
balancer of the process, and are daemons: they die with the server.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import multiprocessing.pool
from collections import deque
from dataclasses import dataclass

import numpy as np

from . import limits
from ._gen.eplb.v1 import balancer_pb2 as pb
from .errors import DeadlineExceeded, ResourceExhausted

__all__ = ["Job", "Solved", "Solver", "solve"]


@dataclass(frozen=True)
class Job:
    """One plan: ``loads`` float64 ``[L, E]``, ``previous`` int32 ``[L, P]`` or None (a fresh
    plan), library ``options``; ``baseline`` int32 ``[L, P]``, the placement that ``moves``,
    the gain and the transfer are measured against (``previous`` when it is set, else the
    placement in service, else None: contiguous); ``expert_bytes`` 0: no TransferStats."""

    loads: np.ndarray
    topology: tuple[int, int, int, int, int, int]
    policy: str
    previous: np.ndarray | None
    options: dict
    baseline: np.ndarray | None = None
    expert_bytes: int = 0


@dataclass(frozen=True)
class Solved:
    """``phy2log`` int32 ``[L, P]``, ``logcnt`` int32 ``[L, E]``, and the plan's stats."""

    phy2log: np.ndarray
    logcnt: np.ndarray
    stats: pb.PlanStats


def solve(job: Job) -> tuple[np.ndarray, np.ndarray, bytes]:
    """Runs in a worker: the plan of ``job`` → ``phy2log``, ``logcnt``, serialized ``PlanStats``."""
    import eplb

    from . import codec

    topo = eplb.Topology(*job.topology)
    previous = eplb.Placement(job.previous, topo) if job.previous is not None else None
    base_arr = job.baseline if job.baseline is not None else job.previous
    baseline = eplb.Placement(base_arr, topo) if base_arr is not None else eplb.Placement.contiguous(topo)
    before = float(eplb.imbalance(eplb.gpu_loads(job.loads, baseline)).mean())
    plan = eplb.rebalance(job.loads, topo, job.policy, previous=previous, **job.options)
    stats = codec.plan_stats(plan, before)
    if previous is None and base_arr is not None:
        stats.moves = int(eplb.moves(baseline, plan.placement).sum())
    if job.expert_bytes and base_arr is not None:
        stats.transfer.CopyFrom(codec.transfer_stats(baseline, plan.placement, topo, job.expert_bytes))
    return plan.phy2log.astype(np.int32), plan.logcnt.astype(np.int32), stats.SerializeToString()


class _Slot:
    """One worker process (a ``Pool`` of one, so it can be killed alone when a call's deadline
    passes: CP-SAT overruns its time limit while it builds a large model)."""

    def __init__(self) -> None:
        self._pool: multiprocessing.pool.Pool | None = None

    def run(self, job: Job, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(1)
        fut = loop.create_future()

        def done(value: object) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))

        def failed(exc: BaseException) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(exc))

        self._pool.apply_async(solve, (job,), callback=done, error_callback=failed)
        return fut

    def kill(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None


class _Slots:
    """``n`` worker slots shared by every balancer of this process, one job at a time each."""

    def __init__(self, n: int) -> None:
        self.free = [_Slot() for _ in range(n)]
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def _acquire(self) -> _Slot:
        if self.free:
            return self.free.pop()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(fut.result())  # handed a slot just as the caller gave up
            raise

    def _release(self, slot: _Slot) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self.free.append(slot)

    async def run(self, job: Job, timeout: float | None) -> tuple[np.ndarray, np.ndarray, bytes]:
        slot = await self._acquire()
        try:
            return await asyncio.wait_for(slot.run(job, asyncio.get_running_loop()), timeout)
        except (TimeoutError, asyncio.CancelledError):
            slot.kill()  # the worker may still be solving: its CPU comes back now, not later
            raise
        finally:
            self._release(slot)


_SLOTS: dict[tuple[str, int], _Slots] = {}


@atexit.register
def _stop_workers() -> None:
    # Before the interpreter tears down what Pool.__del__ needs (noisy tracebacks otherwise).
    for slots in _SLOTS.values():
        for slot in slots.free:
            slot.kill()


def _slots(kind: str, n: int) -> _Slots:
    if (kind, n) not in _SLOTS:
        _SLOTS[(kind, n)] = _Slots(n)
    return _SLOTS[(kind, n)]


class Solver:
    """Runs :class:`Job` s in worker processes: ``workers`` for re-plans, ``compute_workers`` for
    stateless calls (0: in a thread of this process, as the service did before; only to measure
    what the workers buy)."""

    def __init__(self, workers: int = limits.REPLAN_WORKERS, compute_workers: int = limits.COMPUTE_WORKERS) -> None:
        self.workers = workers
        self.compute_workers = compute_workers

    async def replan(self, job: Job) -> Solved:
        """A deployment's re-plan, in the re-plan workers."""
        return await self._run("replan", self.workers, job, None)

    async def compute(self, job: Job, deadline_s: float | None) -> Solved:
        """A stateless call's plan in the compute workers, killed when ``deadline_s`` passes;
        RESOURCE_EXHAUSTED when every worker is busy and ``limits.COMPUTE_QUEUE`` calls wait."""
        if self.compute_workers:
            slots = _slots("compute", self.compute_workers)
            if slots.waiting >= limits.COMPUTE_QUEUE:
                raise ResourceExhausted(
                    f"ComputePlacement is at capacity: {self.compute_workers} plans running and "
                    f"{slots.waiting} waiting (at most {limits.COMPUTE_QUEUE}); retry with backoff"
                )
        try:
            return await self._run("compute", self.compute_workers, job, deadline_s)
        except TimeoutError:
            raise DeadlineExceeded(f"the plan did not finish within the call's deadline ({deadline_s:.3g}s)") from None

    async def _run(self, kind: str, workers: int, job: Job, timeout: float | None) -> Solved:
        if workers == 0:
            phy2log, logcnt, stats = await asyncio.wait_for(asyncio.to_thread(solve, job), timeout)
        else:
            phy2log, logcnt, stats = await _slots(kind, workers).run(job, timeout)
        return Solved(phy2log, logcnt, pb.PlanStats.FromString(stats))

"""Where plans run: small pools of worker processes, so the event loop only serves.

A plan holds the GIL for milliseconds to seconds; run in the server's process it stalls every
call the instance serves (GetPlacement p99 rose from 1.8 ms to 34 ms with re-plans running).
Each job travels to a worker as arrays (loads ``[L, E]``, the previous ``phy2log [L, P]``) and
comes back as ``phy2log``, ``logcnt`` and the serialized ``PlanStats``.

Re-plans of deployments (Rebalance and the trigger loop) run in two lanes: plans of fewer than
``limits.SMALL_PLAN_CELLS`` layers x slots may take a worker of either, larger ones only the
re-plan workers, so a small deployment's re-plan never waits behind big ones (two limit-size
re-plans take both re-plan workers for ~10 s each; the small plan takes ~0.1 s in the lane). A
separate pool serves stateless ComputePlacement calls, which is bounded (``limits.COMPUTE_*``) and refuses calls
beyond its queue with RESOURCE_EXHAUSTED, so remote callers can never take the capacity that
triggered re-plans need. A stateless call's worker is killed when the call's deadline passes.
Workers are spawned (never forked from a process running gRPC) on first use and shared by every
balancer of the process. They are not daemons, so a re-plan can plan its layers in processes of
its own (``BalancerConfig.layer_workers``, ``eplb serve --layer-workers``), and they still die with
the server: each exits when its pipe to the server closes, and the server kills them, with the
processes they started, at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import multiprocessing.util  # registers its exit hook before ours: ours runs first
import os
import signal
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from eplb import limits
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .errors import DeadlineExceeded, ResourceExhausted

# How long a ComputePlacement refused at capacity is told to wait (its retry hint): a stateless
# plan takes tenths of a second to seconds, so a second lets the queue move.
COMPUTE_PUSHBACK_S = 1.0

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
    if plan.predicted_ms:
        # The placement in service at the same batch sizes: what the time gate weighs the plan against.
        from eplb.timing import batches_from, predicted_layer_us

        o = job.options
        batches = batches_from(o["tokens_per_gpu"])
        was = predicted_layer_us(baseline, job.loads, o["kernel_curve"], o["tokens_per_gpu"], o["top_k"], o["dispatch"])
        was_ms = was.sum(axis=0) / 1000.0
        stats.predicted_ms_before.update({int(b): float(m) for b, m in zip(batches.sizes, was_ms)})
        now_ms = np.array([plan.predicted_ms[int(b)] for b in batches.sizes])
        stats.predicted_saved_ms = float((batches.weights * (was_ms - now_ms)).sum())
        was_mean = float((batches.weights * was_ms).sum())
        stats.predicted_gain_percent = 100.0 * stats.predicted_saved_ms / was_mean if was_mean > 0 else 0.0
    return plan.phy2log.astype(np.int32), plan.logcnt.astype(np.int32), stats.SerializeToString()


# Every slot, busy or free, so that exit kills them all.
_ALL: weakref.WeakSet[_Slot] = weakref.WeakSet()


class _Slot:
    """One worker process, one job at a time, killed alone when a call's deadline passes (CP-SAT
    overruns its time limit while it builds a large model). Not a daemon, unlike a ``Pool``'s
    workers, so a re-plan may plan its layers in processes of its own (``workers=``); it still
    dies with the server: it exits when its pipe to the server closes (the server exited or was
    killed), and the server kills it at exit. ``lane``: the lane of :class:`_Slots` it serves."""

    def __init__(self, plugins: tuple[str, ...] = (), lane: str = "") -> None:
        self.plugins = plugins
        self.lane = lane
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        _ALL.add(self)

    def run(self, job: Job, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        if self._proc is None or not self._proc.is_alive():
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe()
            self._proc = ctx.Process(target=_work, args=(theirs, self.plugins), name="eplb-plan", daemon=False)
            # SIGINT blocked while the worker starts (the mask is inherited through spawn): a
            # terminal's Ctrl-C reaching it before it leads its own group (``_work``) would
            # print a KeyboardInterrupt traceback from its start-up; the server stops it.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                self._proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            theirs.close()
            self._conn = ours
        conn = self._conn
        conn.send(job)
        return loop.run_in_executor(None, _answer, conn)

    def kill(self, wait_s: float = 0.0) -> None:
        """Kills the worker and what it started; with ``wait_s``, an idle worker first gets that
        long to exit by itself (it reads the pipe's end, shuts its layer pools down and exits),
        so that their semaphores are released rather than reported leaked at the server's exit."""
        if self._proc is not None:
            if wait_s > 0:
                self._conn.close()
                self._proc.join(wait_s)
            # The worker leads its own process group (``_work``), which holds what it started:
            # the layer workers of ``workers=`` and their forkserver would outlive it otherwise.
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its own group: itself only
                self._proc.kill()
            self._proc.join()
            self._conn.close()
            self._proc = self._conn = None


def _work(conn: Connection, plugins: tuple[str, ...]) -> None:
    """A worker's loop: jobs in, ``("ok", result)`` or ``("error", exception)`` out, until the
    server's end of the pipe closes. ``plugins``: modules whose policies the jobs may name (the
    server loaded them already; see :mod:`.plugins`)."""
    from . import plugins as plugin_loader

    # A group of its own, so that kill() takes every process a plan starts with it (and a
    # terminal's Ctrl-C reaches only the server, which stops the workers itself).
    os.setpgrp()
    # Ignored, then unblocked (a Ctrl-C sent while it started is dropped, not raised here).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    plugin_loader.load(plugins)
    try:
        _serve(conn)
    finally:
        from eplb.workers import shutdown_pools

        shutdown_pools()  # else this process's exit waits on the layer workers forever


def _serve(conn: Connection) -> None:
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[str, object] = ("ok", solve(job))
        except Exception as exc:  # travels back and is raised in the server, as Pool did
            answer = ("error", exc)
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return
        except Exception as exc:  # an exception that does not pickle: send what it said
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


def _answer(conn: Connection) -> tuple[np.ndarray, np.ndarray, bytes]:
    try:
        kind, value = conn.recv()
    except (EOFError, OSError) as exc:
        raise RuntimeError("the planning worker exited before it answered") from exc
    if kind == "error":
        raise value
    return value


class _Slots:
    """Worker slots shared by every balancer of this process, one job at a time each, in lanes:
    ``lanes`` maps a lane's name to its number of slots. A job names the lanes it may run in, in
    order of preference; a freed slot goes to the longest-waiting job that accepts its lane."""

    def __init__(self, lanes: dict[str, int], plugins: tuple[str, ...] = ()) -> None:
        self.free = {lane: [_Slot(plugins, lane) for _ in range(n)] for lane, n in lanes.items()}
        self._waiters: deque[tuple[asyncio.Future, tuple[str, ...]]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f, _ in self._waiters if not f.done())

    async def _acquire(self, lanes: tuple[str, ...]) -> _Slot:
        for lane in lanes:
            if self.free[lane]:
                return self.free[lane].pop()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, lanes))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(fut.result())  # handed a slot just as the caller gave up
            raise

    def _release(self, slot: _Slot) -> None:
        for i, (fut, lanes) in enumerate(self._waiters):
            if not fut.done() and slot.lane in lanes:
                del self._waiters[i]
                fut.set_result(slot)
                break
        else:
            self.free[slot.lane].append(slot)
        while self._waiters and self._waiters[0][0].done():  # callers that gave up
            self._waiters.popleft()

    async def run(
        self, job: Job, timeout: float | None, lanes: tuple[str, ...] = ("",)
    ) -> tuple[np.ndarray, np.ndarray, bytes]:
        slot = await self._acquire(lanes)
        try:
            return await asyncio.wait_for(slot.run(job, asyncio.get_running_loop()), timeout)
        except (TimeoutError, asyncio.CancelledError):
            slot.kill()  # the worker may still be solving: its CPU comes back now, not later
            raise
        finally:
            self._release(slot)


_SLOTS: dict[tuple[str, tuple[tuple[str, int], ...], tuple[str, ...]], _Slots] = {}


# How long the server's exit waits for idle workers to leave by themselves before killing them.
_EXIT_WAIT_S = 2.0


@atexit.register
def _stop_workers() -> None:
    # Before multiprocessing's own exit hook, which joins non-daemon children: an idle worker
    # waits on its pipe, a busy one may plan for seconds. Every pipe is closed first, so the
    # idle workers leave together; a busy one is killed when the wait is up.
    slots = [slot for slot in list(_ALL) if slot._proc is not None]
    for slot in slots:
        slot._conn.close()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for slot in slots:
        slot.kill(wait_s=max(0.01, deadline - time.monotonic()))


def _slots(kind: str, lanes: dict[str, int], plugins: tuple[str, ...] = ()) -> _Slots:
    key = (kind, tuple(sorted(lanes.items())), plugins)
    if key not in _SLOTS:
        _SLOTS[key] = _Slots(lanes, plugins)
    return _SLOTS[key]


class Solver:
    """Runs :class:`Job` s in worker processes: ``workers`` for re-plans, plus ``small_workers``
    that only plans below ``limits.SMALL_PLAN_CELLS`` take (0: no such lane, every re-plan
    queues for ``workers``), and ``compute_workers`` for stateless calls (0: in a thread of this
    process, as the service did before; only to measure what the workers buy); ``plugins``:
    modules every worker imports first (:mod:`.plugins`)."""

    def __init__(
        self,
        workers: int = limits.REPLAN_WORKERS,
        compute_workers: int = limits.COMPUTE_WORKERS,
        plugins: tuple[str, ...] = (),
        small_workers: int = limits.SMALL_PLAN_WORKERS,
    ) -> None:
        self.workers = workers
        self.compute_workers = compute_workers
        self.small_workers = small_workers
        self.plugins = tuple(plugins)

    @staticmethod
    def is_small(job: Job) -> bool:
        """Whether ``job`` may plan in the small lane: fewer than ``limits.SMALL_PLAN_CELLS``
        layers x slots (a plan's time grows with both; a limit-size one has 2^20)."""
        return Solver.is_small_topology(job.topology)

    @staticmethod
    def is_small_topology(topology: tuple[int, int, int, int, int, int]) -> bool:
        """:meth:`is_small` of a job of ``topology`` (``Job.topology``)."""
        return topology[0] * topology[2] < limits.SMALL_PLAN_CELLS

    async def replan(self, job: Job) -> Solved:
        """A deployment's re-plan: a small one in a free worker of either lane (its own first), a
        larger one in the re-plan workers only."""
        if self.workers == 0:
            return await self._run("replan", {}, job, None)
        lanes = {"replan": self.workers}
        order: tuple[str, ...] = ("replan",)
        if self.small_workers:
            lanes["small"] = self.small_workers
            if self.is_small(job):
                order = ("small", "replan")
        return await self._run("replan", lanes, job, None, order)

    async def compute(self, job: Job, deadline_s: float | None) -> Solved:
        """A stateless call's plan in the compute workers, killed when ``deadline_s`` passes;
        RESOURCE_EXHAUSTED when every worker is busy and ``limits.COMPUTE_QUEUE`` calls wait."""
        lanes = {"compute": self.compute_workers} if self.compute_workers else {}
        if self.compute_workers:
            slots = _slots("compute", lanes, self.plugins)
            if slots.waiting >= limits.COMPUTE_QUEUE:
                raise ResourceExhausted(
                    f"ComputePlacement is at capacity: {self.compute_workers} plans running and "
                    f"{slots.waiting} waiting (at most {limits.COMPUTE_QUEUE}); retry with backoff",
                    retry_after_s=COMPUTE_PUSHBACK_S,
                )
        try:
            return await self._run("compute", lanes, job, deadline_s, ("compute",))
        except TimeoutError:
            raise DeadlineExceeded(f"the plan did not finish within the call's deadline ({deadline_s:.3g}s)") from None

    async def _run(
        self,
        kind: str,
        lanes: dict[str, int],
        job: Job,
        timeout: float | None,
        order: tuple[str, ...] = (),
    ) -> Solved:
        if not lanes:
            phy2log, logcnt, stats = await asyncio.wait_for(asyncio.to_thread(solve, job), timeout)
        else:
            phy2log, logcnt, stats = await _slots(kind, lanes, self.plugins).run(job, timeout, order)
        return Solved(phy2log, logcnt, pb.PlanStats.FromString(stats))

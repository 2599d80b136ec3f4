"""Applying a placement at a step boundary, on every rank at once.

A new map is only correct once every rank routes with it from the same step on, and only
after every weight it routes to has arrived. ``Rollout`` runs that protocol on one rank:

1. **offer**: the watcher hands over a new version (any thread; the latest wins);
2. **prepare**: on a worker thread, the ``Applier`` moves weights for the new map while the
   engine keeps routing with the old one (it must not disturb a slot the old map routes to:
   it stages the incoming weights and writes them at commit);
3. **ready**: the rank says it prepared (an ``ACK_STATE_PREPARED`` ack, or a flag in an
   all-reduce);
4. **switch**: once every rank is ready, all of them switch at one agreed step: ``commit``
   writes the staged weights and ``step()`` returns the new map from that step on;
5. **roll back**: a prepare that fails or runs past ``timeout_s``, or a rank that reports
   failure, makes every rank ``rollback`` and keep the old map; the failure is acked as
   ``ACK_STATE_FAILED`` with the error, which the service counts.

The agreement comes from a ``Barrier``, two of which are here: ``ServiceBarrier`` (through
the service's ``AckPlacement``: the switch step is the largest PREPARED step plus the
deployment's ``switch_margin_steps``) and ``ProcessGroupBarrier`` (through the engine's own
``torch.distributed`` group: an all-reduce at each step boundary; the switch is the step at
which the all-reduce shows every rank ready). docs/rollout.md compares them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

import eplb

from .client import ServiceClient
from .wire import PublishedPlacement

__all__ = ["Applier", "MoverApplier", "Barrier", "Local", "Decision", "RolloutEvent", "Rollout", "ServiceBarrier", "ProcessGroupBarrier", "AckSender"]

log = logging.getLogger(__name__)


class Applier(Protocol):
    """What a rank does to its weights; ``WeightMover``-backed appliers live in the engine."""

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        """Moves this rank's weights for ``new`` (on the rollout's worker thread) without
        disturbing any slot ``old`` routes to; raises on failure."""

    def commit(self) -> None:
        """Makes the prepared weights live (at the switch step, on the step thread)."""

    def rollback(self) -> None:
        """Drops whatever ``prepare`` did; the weights ``old`` routes to stay as they were."""


class MoverApplier:
    """An ``Applier`` over ``WeightMover``'s staged mode: ``prepare`` makes a mover for the
    transition and receives every incoming expert into its buffers (live slots only read),
    ``commit`` writes the live slots within each gpu, ``rollback`` drops the buffers.

    ``layers``: this rank's tensors per layer (``WeightMover``'s ``layers``); ``group``: the
    process group the mover talks through. With the service barrier the ranks start preparing
    at different moments, so give the mover a group of its own (``dist.new_group()``): its
    transfers then wait for the late ranks without holding up the engine's collectives.
    ``mover_options``: ``WeightMover`` keywords (``staging_bytes``, ``layers_per_call``,
    ``verify``, ...). After a switch, ``schedule`` and ``report`` describe the move (with
    ``verify=True``, ``report.mismatches`` lists slots whose checksum differs from the source's).
    """

    def __init__(self, layers: object, group: object = None, **mover_options: object) -> None:
        self.layers, self.group, self.options = layers, group, mover_options
        self.mover = None
        self.schedule = None
        self.report = None
        self.commit_seconds = 0.0

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        from .mover import WeightMover

        self.mover = WeightMover(self.layers, old, new, self.group, **self.options)
        self.schedule = self.mover.schedule
        while self.mover.prepare():
            pass
        # PREPARED is acked after this returns: the received weights must have landed, and a
        # transfer that failed must fail here (rolled back), not at commit() on the step thread.
        self.mover.synchronize()

    def commit(self) -> None:
        start = time.perf_counter()
        self.report = self.mover.commit()
        self.commit_seconds = time.perf_counter() - start
        self.mover = None

    def rollback(self) -> None:
        if self.mover is not None:
            self.mover.rollback()
        self.mover = None


@dataclass(frozen=True)
class Local:
    """One rank's side of a rollout at a step boundary.

    ``current``: version routed with now; ``offered``: newest version this rank has and would
    prepare (``current`` if none); ``target``: version being prepared (0: none); ``prepared``:
    the target's prepare finished; ``failed``: why the target's prepare failed ("" if not).
    """

    current: int
    offered: int
    target: int
    prepared: bool
    failed: str


@dataclass(frozen=True)
class Decision:
    """What the ranks agreed at a step boundary: start preparing ``start`` (0: nothing to
    start), ``switch`` to the target from this step on, or ``abort`` it."""

    start: int = 0
    switch: bool = False
    abort: bool = False


class Barrier(Protocol):
    def sync(self, step: int, local: Local) -> Decision:
        """Called by every rank at every step boundary; returns the agreed decision."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutEvent:
    """A rollout that ended: ``kind`` is ``"switched"``, ``"failed"`` (this rank's prepare) or
    ``"aborted"`` (another rank's, or the barrier's); times in seconds."""

    kind: str
    version: int
    step: int
    prepare_seconds: float
    wait_seconds: float
    error: str = ""


class AckSender:
    """Acks to the service from a background thread, so a step never waits on the network."""

    def __init__(self, client: ServiceClient, deployment: str, rank: int) -> None:
        self.client, self.deployment, self.rank = client, deployment, rank
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=f"eplb-acks-{rank}", daemon=True)
        self._thread.start()

    def send(self, version: int, state: str, step: int = 0, error: str = "",
             on_reply: Callable[[object], None] | None = None) -> None:
        self._queue.put((version, state, step, error, on_reply))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            version, state, step, error, on_reply = item
            try:
                reply = self.client.ack(self.deployment, self.rank, version, state, step=step, error=error)
            except grpc.RpcError as exc:
                self.failures += 1
                log.warning("ack %s of version %d failed: %s", state, version, exc.details())
                continue
            if on_reply is not None:
                on_reply(reply)

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)


class ServiceBarrier:
    """The version-and-step barrier through the service's ``AckPlacement``.

    A rank that finished preparing acks PREPARED with its step and keeps asking (the same ack,
    every ``poll_s``, from a background thread) until the service answers with the switch step
    (every rank prepared) or ``aborted`` (one failed). The rank switches at the first step
    boundary at or after the switch step; the deployment's ``switch_margin_steps`` must cover
    the time an ack takes, or a rank learns of the switch late (counted in ``late``).
    """

    def __init__(self, client: ServiceClient, deployment: str, rank: int, *, poll_s: float = 0.01) -> None:
        self.acks = AckSender(client, deployment, rank)
        self.poll_s = poll_s
        self.late = 0
        self._lock = threading.Lock()
        self._version = 0
        self._switch_step = 0
        self._aborted = False
        self._asked_at = 0.0
        self._prepared_step = 0
        self._failed_sent = 0

    def _on_reply(self, version: int) -> Callable[[object], None]:
        def record(reply: object) -> None:
            with self._lock:
                if version == self._version:
                    self._switch_step = self._switch_step or reply.switch_step
                    self._aborted = self._aborted or reply.aborted
        return record

    def sync(self, step: int, local: Local) -> Decision:
        if local.target == 0:
            return Decision(start=local.offered) if local.offered > local.current else Decision()
        with self._lock:
            if local.target != self._version:
                self._version, self._switch_step, self._aborted, self._asked_at = local.target, 0, False, 0.0
            switch_step, aborted = self._switch_step, self._aborted
        if local.failed:
            if self._failed_sent != local.target:
                self._failed_sent = local.target
                self.acks.send(local.target, "failed", step, local.failed)
            return Decision(abort=True)
        if not local.prepared:
            return Decision()
        if aborted:
            return Decision(abort=True)
        if switch_step and step >= switch_step:
            if step > switch_step:
                self.late += 1
                log.warning("switching to version %d at step %d, after the agreed step %d", local.target, step, switch_step)
            self.acks.send(local.target, "switched", step)
            return Decision(switch=True)
        now = time.monotonic()
        if not switch_step and now - self._asked_at >= self.poll_s:
            # Re-asking with the step of the first PREPARED ack keeps the agreed step where it was.
            if self._asked_at == 0.0:
                self._prepared_step = step
            self._asked_at = now
            self.acks.send(local.target, "prepared", self._prepared_step, on_reply=self._on_reply(local.target))
        return Decision()

    def close(self) -> None:
        self.acks.close()


class ProcessGroupBarrier:
    """The barrier through the engine's own ``torch.distributed`` group: one all-reduce of six
    int64 values per step boundary, so every rank gets the same decision at the same step.

    Preparing starts once every rank holds the same newest version; the switch comes at the
    first step boundary at which every rank finished preparing it; any rank's failure aborts
    it everywhere. ``acks`` (optional) tells the service what happened, for its counts.
    """

    def __init__(self, group: object = None, acks: AckSender | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self.group, self.acks = torch, dist, group, acks
        self._failed_sent = 0

    def sync(self, step: int, local: Local) -> Decision:
        t = self._torch.tensor(
            [local.offered, -local.offered, local.target, -local.target, int(local.target > 0 and not local.prepared), int(bool(local.failed))],
            dtype=self._torch.int64,
        )
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        max_offered, min_offered, max_target, min_target, not_ready, failed = (int(v) for v in t.tolist())
        min_offered, min_target = -min_offered, -min_target
        if max_target == 0:
            if min_offered == max_offered and min_offered > local.current:
                return Decision(start=min_offered)
            return Decision()
        if failed or min_target != max_target:
            if self.acks is not None and local.failed and self._failed_sent != local.target:
                self._failed_sent = local.target
                self.acks.send(local.target, "failed", step, local.failed)
            return Decision(abort=True)
        if not_ready == 0:
            if self.acks is not None:
                self.acks.send(local.target, "switched", step)
            return Decision(switch=True)
        return Decision()

    def close(self) -> None:
        if self.acks is not None:
            self.acks.close()


@dataclass
class _Prepare:
    """The prepare in flight: its worker thread and outcome."""

    published: PublishedPlacement
    started: float
    thread: threading.Thread | None = None
    done: bool = False
    error: str = ""
    seconds: float = 0.0
    ready_at: float = 0.0


class Rollout:
    """One rank's rollout of published placements; ``step(step)`` at every step boundary.

    ``initial``: the placement routed with now. ``timeout_s`` bounds a prepare plus the wait
    for the other ranks. ``on_event(RolloutEvent)`` runs on the step thread after a switch,
    failure or abort. ``current`` is the placement to route with.
    """

    def __init__(
        self,
        initial: PublishedPlacement,
        applier: Applier,
        barrier: Barrier,
        *,
        timeout_s: float = 120.0,
        on_event: Callable[[RolloutEvent], None] | None = None,
    ) -> None:
        self.current = initial
        self.applier, self.barrier, self.timeout_s, self.on_event = applier, barrier, timeout_s, on_event
        self.events: list[RolloutEvent] = []
        self._lock = threading.Lock()
        self._offered: PublishedPlacement | None = None
        self._refused = 0  # a version that failed here is not prepared again
        self._prep: _Prepare | None = None

    def offer(self, published: PublishedPlacement) -> None:
        """Hands over a new version (e.g. as ``PlacementWatcher``'s callback); the latest wins."""
        with self._lock:
            if published.version > max(self.current.version, self._offered.version if self._offered else 0):
                self._offered = published

    def _local(self) -> Local:
        with self._lock:
            offered = self._offered.version if self._offered and self._offered.version > self._refused else self.current.version
        prep = self._prep
        if prep is None:
            return Local(self.current.version, offered, 0, False, "")
        error = prep.error
        if not prep.done and not error and time.monotonic() - prep.started > self.timeout_s:
            error = prep.error = f"prepare of version {prep.published.version} timed out after {self.timeout_s:g} s"
        elif prep.done and not error and time.monotonic() - prep.ready_at > self.timeout_s:
            error = prep.error = f"version {prep.published.version}: other ranks not ready {self.timeout_s:g} s after this one"
        return Local(self.current.version, offered, prep.published.version, prep.done and not error, error)

    def step(self, step: int) -> PublishedPlacement:
        """At a step boundary: advances the rollout and returns the placement to route with
        from this step on (the new one on the switch step)."""
        decision = self.barrier.sync(step, self._local())
        prep = self._prep
        if decision.start and prep is None:
            with self._lock:
                target = self._offered
            if target is not None and target.version == decision.start:
                self._start(target)
        elif decision.switch and prep is not None:
            self.applier.commit()
            self.current = prep.published
            self._prep = None
            self._event(RolloutEvent("switched", prep.published.version, step, prep.seconds, time.monotonic() - prep.ready_at))
        elif decision.abort and prep is not None and (prep.done or prep.error):
            self._abort(prep, step)
        return self.current

    def _start(self, target: PublishedPlacement) -> None:
        prep = self._prep = _Prepare(target, time.monotonic())
        old = self.current.placement

        def run() -> None:
            try:
                self.applier.prepare(old, target.placement)
            except Exception as exc:  # reported through the barrier, then rolled back
                log.exception("preparing version %d failed", target.version)
                prep.error = prep.error or f"{type(exc).__name__}: {exc}"
            prep.seconds = time.monotonic() - prep.started
            prep.ready_at = time.monotonic()
            prep.done = True

        prep.thread = threading.Thread(target=run, name=f"eplb-prepare-{target.version}", daemon=True)
        prep.thread.start()

    def _abort(self, prep: _Prepare, step: int) -> None:
        if prep.thread is not None and prep.thread.is_alive():
            return  # a timed-out prepare still running: roll back once it returns
        self.applier.rollback()
        self._prep = None
        mine = bool(prep.error)
        with self._lock:  # an aborted version is not prepared again; a newer one may be
            self._refused = max(self._refused, prep.published.version)
        wait = time.monotonic() - prep.ready_at if prep.done else 0.0
        self._event(RolloutEvent("failed" if mine else "aborted", prep.published.version, step, prep.seconds, wait, prep.error))

    def _event(self, event: RolloutEvent) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def close(self) -> None:
        self.barrier.close()

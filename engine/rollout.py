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

**Chunks.** An applier with a memory budget (``MoverApplier``'s ``staging_bytes``) may switch
a version in chunks of layers: prepare chunk k, switch its layers at an agreed step, then
chunk k + 1. Each MoE layer routes with its own map, so between chunks the routing map
(``Rollout.routing``) takes the switched layers from the new placement and the others from
the old, and every layer's weights match its own map. Only ``ProcessGroupBarrier`` agrees
a step per chunk; ``ServiceBarrier`` switches whole versions (one agreed step per version)
and fails a prepare that needs several chunks. If a chunk fails after earlier chunks
switched, every rank moves those layers back (a reverse transition, chunked the same way) so
that the ranks end on the version the service knows; only if that fails too is the map left
mixed (a ``"partial"`` event), and the next version moves from the mixed map.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

import eplb

from .client import ServiceClient
from .wire import PublishedPlacement

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Applier",
    "MoverApplier",
    "Barrier",
    "Local",
    "Decision",
    "RolloutEvent",
    "Rollout",
    "ServiceBarrier",
    "ProcessGroupBarrier",
    "AckSender",
]

# MoverApplier's receive-buffer budget: 1 GiB holds 24 DeepSeek-V3 experts (44 MB), at least
# two layers of a full re-plan (9 slots a layer per gpu); a small model fits in one chunk.
DEFAULT_STAGING_BYTES = 1 << 30

log = logging.getLogger(__name__)


class Applier(Protocol):
    """What a rank does to its weights; ``WeightMover``-backed appliers live in the engine.

    A chunked applier also has ``chunks`` (the layers of each chunk, the same on every rank,
    set by ``prepare``) and ``prepare_next()``: ``prepare`` then prepares chunk 0, each
    ``commit`` makes one chunk live, ``prepare_next`` prepares the chunk after the last
    committed one. Without them the applier moves whole versions (one chunk of every layer).
    """

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        """Moves this rank's weights for ``new`` (on the rollout's worker thread) without
        disturbing any slot ``old`` routes to; raises on failure."""

    def commit(self) -> None:
        """Makes the prepared weights live (at the switch step, on the step thread)."""

    def rollback(self) -> None:
        """Drops whatever the prepare in flight did; the layers not yet committed keep the
        weights ``old`` routes to."""


class MoverApplier:
    """An ``Applier`` over ``WeightMover``'s staged mode, in chunks of layers whose receive
    buffers fit ``staging_bytes`` (``DEFAULT_STAGING_BYTES``; ``None``: one chunk, every
    incoming expert of the transition held at once): ``prepare`` makes a mover for the
    transition and receives chunk 0's incoming experts into its buffers (live slots only
    read), ``commit`` writes the chunk's live slots within each gpu, ``prepare_next``
    receives the next chunk into the same buffers, ``rollback`` drops them.

    ``layers``: this rank's tensors per layer (``WeightMover``'s ``layers``); ``group``: the
    process group the mover talks through. With the service barrier the ranks start preparing
    at different moments, so give the mover a group of its own (``dist.new_group()``): its
    transfers then wait for the late ranks without holding up the engine's collectives.
    ``mover_options``: other ``WeightMover`` keywords (``layers_per_call``, ``verify``, ...).
    After a version switched, ``schedule`` and ``report`` (summed over its chunks) describe
    the move (with ``verify=True``, ``report.mismatches`` lists slots whose checksum differs
    from the source's); ``commit_seconds`` is the longest ``commit()``, the stall of one step.
    """

    def __init__(
        self,
        layers: object,
        group: object = None,
        *,
        staging_bytes: int | None = DEFAULT_STAGING_BYTES,
        **mover_options: object,
    ) -> None:
        self.layers, self.group, self.staging_bytes, self.options = layers, group, staging_bytes, mover_options
        self.mover = None
        self.schedule = None
        self.chunks: tuple[tuple[int, ...], ...] = ()
        self.report = None
        self.commit_seconds = 0.0
        self.staged_bytes = 0  # receive-buffer bytes of the last mover

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        from .mover import WeightMover

        self.mover = WeightMover(self.layers, old, new, self.group, staging_bytes=self.staging_bytes, **self.options)
        self.schedule = self.mover.schedule
        self.chunks = tuple(tuple(chunk) for chunk in self.mover.chunks)  # ValueError: a layer does not fit
        self.staged_bytes = self.mover.staging_bytes_needed("staged")
        self._reports = []
        self._commits = []
        self.prepare_next()

    def prepare_next(self) -> None:
        while self.mover.prepare():
            pass
        # PREPARED is acked after this returns: the received weights must have landed, and a
        # transfer that failed must fail here (rolled back), not at commit() on the step thread.
        self.mover.synchronize()

    def commit(self) -> None:
        start = time.perf_counter()
        self._reports.append(self.mover.commit())
        self._commits.append(time.perf_counter() - start)
        if self.mover.done:
            self.report = _sum_reports(self._reports)
            self.commit_seconds = max(self._commits)
            self.mover = None

    def rollback(self) -> None:
        if self.mover is not None:
            self.mover.rollback()
        self.mover = None


def _sum_reports(reports: Sequence[object]) -> object:
    from .mover import MoveReport

    return MoveReport(
        layers=tuple(layer for r in reports for layer in r.layers),
        received_bytes=sum(r.received_bytes for r in reports),
        sent_bytes=sum(r.sent_bytes for r in reports),
        local_copy_bytes=sum(r.local_copy_bytes for r in reports),
        checked_slots=sum(r.checked_slots for r in reports),
        mismatches=tuple(m for r in reports for m in r.mismatches),
    )


@dataclass(frozen=True)
class Local:
    """One rank's side of a rollout at a step boundary.

    ``current``: version routed with now; ``offered``: newest version this rank has and would
    prepare (``current`` if none); ``target``: version being prepared (0: none; ``current``
    while moving the switched layers of an aborted version back); ``prepared``: the target's
    prepare (of its chunk ``chunk``) finished; ``failed``: why the target's prepare failed (""
    if not); ``final``: ``chunk`` is the target's last; ``revert``: nothing in flight, but
    layers of an aborted version switched here and wait to be moved back.
    """

    current: int
    offered: int
    target: int
    prepared: bool
    failed: str
    chunk: int = 0
    final: bool = True
    revert: bool = False


@dataclass(frozen=True)
class Decision:
    """What the ranks agreed at a step boundary: start preparing ``start`` (0: nothing to
    start; the current version: move an aborted version's switched layers back), ``switch``
    to the target (its current chunk's layers) from this step on, or ``abort`` it."""

    start: int = 0
    switch: bool = False
    abort: bool = False


class Barrier(Protocol):
    chunked: bool  # agrees a switch step per chunk (else: whole versions only)

    def sync(self, step: int, local: Local) -> Decision:
        """Called by every rank at every step boundary; returns the agreed decision."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutEvent:
    """A rollout that ended: ``kind`` is ``"switched"``, ``"failed"`` (this rank's prepare) or
    ``"aborted"`` (another rank's, or the barrier's); after a failure in a later chunk,
    ``"reverted"`` (the switched layers moved back: ``version`` routes everywhere again) or
    ``"partial"`` (moving them back failed too: ``Rollout.routing`` mixes versions). Times in
    seconds, summed over the chunks; ``chunks``: chunk switches it took."""

    kind: str
    version: int
    step: int
    prepare_seconds: float
    wait_seconds: float
    error: str = ""
    chunks: int = 1


class AckSender:
    """Acks to the service from a background thread, so a step never waits on the network."""

    def __init__(self, client: ServiceClient, deployment: str, rank: int) -> None:
        self.client, self.deployment, self.rank = client, deployment, rank
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name=f"eplb-acks-{rank}", daemon=True)
        self._thread.start()

    def send(
        self, version: int, state: str, step: int = 0, error: str = "", on_reply: Callable[[object], None] | None = None
    ) -> None:
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
    It agrees one step per version: it cannot switch chunked versions (``chunked`` False).
    """

    chunked = False

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
                log.warning(
                    "switching to version %d at step %d, after the agreed step %d", local.target, step, switch_step
                )
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
    """The barrier through the engine's own ``torch.distributed`` group: one all-reduce of ten
    int64 values per step boundary, so every rank gets the same decision at the same step.

    Preparing starts once every rank holds the same newest version; the switch (of the
    target's next chunk) comes at the first step boundary at which every rank finished
    preparing it; any rank's failure aborts it everywhere; once every rank has rolled back,
    ranks holding switched layers of the aborted version start moving them back together.
    ``acks`` (optional) tells the service what happened, for its counts.
    """

    chunked = True

    def __init__(self, group: object = None, acks: AckSender | None = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self.group, self.acks = torch, dist, group, acks
        self._failed_sent = 0

    def sync(self, step: int, local: Local) -> Decision:
        pairs = (local.offered, local.target, local.chunk, int(local.revert))
        t = self._torch.tensor(
            [v for x in pairs for v in (x, -x)]
            + [int(local.target > 0 and not local.prepared), int(bool(local.failed))],
            dtype=self._torch.int64,
        )
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        v = [int(x) for x in t.tolist()]
        (max_offered, min_offered), (max_target, min_target), (max_chunk, min_chunk), (max_revert, min_revert) = (
            (v[i], -v[i + 1]) for i in range(0, 8, 2)
        )
        not_ready, failed = v[8], v[9]
        if max_target == 0:
            if max_revert:  # layers of an aborted version to move back: once every rank rolled back
                return Decision(start=local.current) if min_revert else Decision()
            if min_offered == max_offered and min_offered > local.current:
                return Decision(start=min_offered)
            return Decision()
        moving_back = local.target == local.current  # acks are about versions, not about reverts
        if failed or min_target != max_target or min_chunk != max_chunk:
            if self.acks is not None and local.failed and not moving_back and self._failed_sent != local.target:
                self._failed_sent = local.target
                self.acks.send(local.target, "failed", step, local.failed)
            return Decision(abort=True)
        if not_ready == 0:
            if self.acks is not None and local.final and not moving_back:
                self.acks.send(local.target, "switched", step)
            return Decision(switch=True)
        return Decision()

    def close(self) -> None:
        if self.acks is not None:
            self.acks.close()


@dataclass
class _Prepare:
    """The prepare in flight (of one chunk at a time): its worker thread and outcome."""

    published: PublishedPlacement
    started: float
    revert: bool = False  # moving an aborted version's switched layers back to ``published``
    chunks: tuple[tuple[int, ...], ...] = ()  # known once chunk 0 is prepared
    chunk: int = 0
    thread: threading.Thread | None = None
    done: bool = False
    error: str = ""
    seconds: float = 0.0  # this chunk's prepare
    ready_at: float = 0.0
    total_prepare: float = 0.0  # over the chunks switched so far
    total_wait: float = 0.0


class Rollout:
    """One rank's rollout of published placements; ``step(step)`` at every step boundary.

    ``initial``: the placement routed with now. ``timeout_s`` bounds a chunk's prepare plus
    the wait for the other ranks. ``on_event(RolloutEvent)`` runs on the step thread after a
    switch, failure or abort. ``on_switch(step, layers, routing)`` runs on the step thread at
    every switch, after the weights of ``layers`` are in place: from ``step`` on those layers
    route with ``routing`` (a whole ``eplb.Placement``; write its rows ``layers`` into the
    engine's maps, e.g. ``apply_to_vllm(state, routing, layers=layers)``). ``current`` is the
    last version switched everywhere; ``routing`` the map to route with (``current``'s, but
    mixed while a chunked version is half switched: ``mixed``).
    """

    def __init__(
        self,
        initial: PublishedPlacement,
        applier: Applier,
        barrier: Barrier,
        *,
        timeout_s: float = 120.0,
        on_event: Callable[[RolloutEvent], None] | None = None,
        on_switch: Callable[[int, tuple[int, ...], eplb.Placement], None] | None = None,
    ) -> None:
        self.current = initial
        self.routing = initial.placement
        self.applier, self.barrier, self.timeout_s = applier, barrier, timeout_s
        self.on_event, self.on_switch = on_event, on_switch
        self.events: list[RolloutEvent] = []
        self._lock = threading.Lock()
        self._offered: PublishedPlacement | None = None
        self._refused = 0  # a version that failed here is not prepared again
        self._prep: _Prepare | None = None
        self._revert = False  # switched layers of an aborted version wait to be moved back
        self._routed = initial

    @property
    def mixed(self) -> bool:
        """Some layers route with a version other than ``current`` (between chunks)."""
        return self.routing is not self.current.placement

    def offer(self, published: PublishedPlacement) -> None:
        """Hands over a new version (e.g. as ``PlacementWatcher``'s callback); the latest wins."""
        with self._lock:
            if published.version > max(self.current.version, self._offered.version if self._offered else 0):
                self._offered = published

    def _local(self) -> Local:
        with self._lock:
            offered = (
                self._offered.version
                if self._offered and self._offered.version > self._refused
                else self.current.version
            )
        prep = self._prep
        if prep is None:
            return Local(self.current.version, offered, 0, False, "", revert=self._revert)
        error = prep.error
        if not prep.done and not error and time.monotonic() - prep.started > self.timeout_s:
            error = prep.error = f"prepare of version {prep.published.version} timed out after {self.timeout_s:g} s"
        elif prep.done and not error and time.monotonic() - prep.ready_at > self.timeout_s:
            error = prep.error = (
                f"version {prep.published.version}: other ranks not ready {self.timeout_s:g} s after this one"
            )
        final = not prep.chunks or prep.chunk == len(prep.chunks) - 1
        return Local(
            self.current.version, offered, prep.published.version, prep.done and not error, error, prep.chunk, final
        )

    def step(self, step: int) -> PublishedPlacement:
        """At a step boundary: advances the rollout and returns the placement to route with
        from this step on: ``current``, or, while ``mixed``, ``current`` with ``placement``
        replaced by ``routing`` (its version is still ``current``'s)."""
        decision = self.barrier.sync(step, self._local())
        prep = self._prep
        if decision.start and prep is None:
            if self._revert:
                if decision.start == self.current.version:
                    self._start(self.current, revert=True)
            else:
                with self._lock:
                    target = self._offered
                if target is not None and target.version == decision.start:
                    self._start(target)
        elif decision.switch and prep is not None:
            self._switch(prep, step)
        elif decision.abort and prep is not None and (prep.done or prep.error):
            self._abort(prep, step)
        return self._routed

    def _start(self, target: PublishedPlacement, revert: bool = False) -> None:
        prep = self._prep = _Prepare(target, time.monotonic(), revert=revert)
        old, new = self.routing, target.placement
        chunked = getattr(self.barrier, "chunked", False)

        def first() -> None:
            self.applier.prepare(old, new)
            chunks = tuple(getattr(self.applier, "chunks", ()) or (tuple(range(new.topology.num_layers)),))
            if len(chunks) > 1 and not chunked:
                raise ValueError(
                    f"version {target.version} needs {len(chunks)} chunks under the applier's staging budget, and "
                    f"{type(self.barrier).__name__} switches whole versions only: raise the applier's staging_bytes "
                    f"(None: every incoming expert at once) or use ProcessGroupBarrier"
                )
            prep.chunks = chunks

        self._run(prep, first)

    def _run(self, prep: _Prepare, body: Callable[[], None]) -> None:
        prep.started, prep.done, prep.error = time.monotonic(), False, ""

        def run() -> None:
            try:
                body()
            except Exception as exc:  # reported through the barrier, then rolled back
                log.exception("preparing version %d failed", prep.published.version)
                prep.error = prep.error or f"{type(exc).__name__}: {exc}"
            prep.seconds = time.monotonic() - prep.started
            prep.ready_at = time.monotonic()
            prep.done = True

        name = f"eplb-{'revert' if prep.revert else 'prepare'}-{prep.published.version}-{prep.chunk}"
        prep.thread = threading.Thread(target=run, name=name, daemon=True)
        prep.thread.start()

    def _switch(self, prep: _Prepare, step: int) -> None:
        layers = prep.chunks[prep.chunk]
        self.applier.commit()
        prep.total_prepare += prep.seconds
        prep.total_wait += time.monotonic() - prep.ready_at
        last = prep.chunk == len(prep.chunks) - 1
        if last:  # the chunks cover every layer: the routing map is the target's
            self._prep = None
            if not prep.revert:
                self.current = prep.published
            self.routing = self.current.placement
        else:
            target = prep.published.placement
            rows = self.routing.phy2log.copy()
            rows[list(layers)] = target.phy2log[list(layers)]
            self.routing = eplb.Placement(rows, target.topology)
        self._routed = self.current if not self.mixed else replace(self.current, placement=self.routing)
        if self.on_switch is not None:
            self.on_switch(step, layers, self.routing)
        if not last:
            prep.chunk += 1
            self._run(prep, self.applier.prepare_next)
            return
        kind = "reverted" if prep.revert else "switched"
        self._revert = False
        self._event(
            RolloutEvent(
                kind, prep.published.version, step, prep.total_prepare, prep.total_wait, chunks=len(prep.chunks)
            )
        )

    def _abort(self, prep: _Prepare, step: int) -> None:
        if prep.thread is not None and prep.thread.is_alive():
            return  # a timed-out prepare still running: roll back once it returns
        self.applier.rollback()
        self._prep = None
        wait = time.monotonic() - prep.ready_at if prep.done else 0.0
        seconds, waited = prep.total_prepare + prep.seconds, prep.total_wait + wait
        if prep.revert:  # moving back failed: the layers switched so far stay as they are
            self._revert = False
            self._routed = self.current if not self.mixed else replace(self.current, placement=self.routing)
            log.error("moving version %d's switched layers back failed: routing stays mixed", prep.published.version)
            self._event(
                RolloutEvent(
                    "partial",
                    prep.published.version,
                    step,
                    seconds,
                    waited,
                    prep.error or "another rank failed",
                    chunks=prep.chunk,
                )
            )
            return
        mine = bool(prep.error)
        with self._lock:  # an aborted version is not prepared again; a newer one may be
            self._refused = max(self._refused, prep.published.version)
        self._revert = self.mixed
        self._event(
            RolloutEvent(
                "failed" if mine else "aborted",
                prep.published.version,
                step,
                seconds,
                waited,
                prep.error,
                chunks=prep.chunk,
            )
        )

    def _event(self, event: RolloutEvent) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def close(self, timeout_s: float = 2.0) -> None:
        """Waits up to ``timeout_s`` for a prepare in flight (its transfers are collective: peers
        closing at the same step finish theirs) and rolls it back, then closes the barrier."""
        prep = self._prep
        if prep is not None and prep.thread is not None:
            prep.thread.join(timeout_s)
            if not prep.thread.is_alive():
                self.applier.rollback()
                self._prep = None
        self.barrier.close()

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

Each rank's side is a state machine (``Phase``: idle, preparing, ready, failed, reverting; the
transitions are listed at ``_TRANSITIONS`` and ``Rollout._enter`` is the only place the phase
changes). Everything happens on the step thread at step boundaries; the prepare is a future on
the rollout's one-worker executor, whose outcome the step thread reads once.

The agreement comes from a ``Barrier``, two of which are here: ``ServiceBarrier`` (through
the service's ``AckPlacement``: the switch step is the largest PREPARED step plus the
deployment's ``switch_margin_steps``) and ``ProcessGroupBarrier`` (through the engine's own
``torch.distributed`` group: an all-reduce at each step boundary; the switch is the step at
which the all-reduce shows every rank ready). docs/rollout.md compares them.

**Chunks.** A ``ChunkedApplier`` (``MoverApplier``, with its memory budget ``staging_bytes``)
may switch a version in chunks of layers: prepare chunk k, switch its layers at an agreed step, then
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

import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import grpc

import eplb

from .client import ServiceClient
from .survivors import GroupMismatch
from .wire import PublishedPlacement

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Applier",
    "ChunkedApplier",
    "MoverApplier",
    "Phase",
    "Barrier",
    "Local",
    "Decision",
    "RolloutEvent",
    "Rollout",
    "ServiceBarrier",
    "ProcessGroupBarrier",
    "RolloutGroup",
    "AckSender",
]

# MoverApplier's receive-buffer budget: 1 GiB holds 24 DeepSeek-V3 experts (44 MB), at least
# two layers of a full re-plan (9 slots a layer per gpu); a small model fits in one chunk.
DEFAULT_STAGING_BYTES = 1 << 30

log = logging.getLogger(__name__)


class Applier(Protocol):
    """What a rank does to its weights; ``WeightMover``-backed appliers live in the engine.
    It moves whole versions (one chunk of every layer) unless it is a ``ChunkedApplier``."""

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        """Moves this rank's weights for ``new`` (on the rollout's worker thread) without
        disturbing any slot ``old`` routes to; raises on failure."""

    def commit(self) -> None:
        """Makes the prepared weights live (at the switch step, on the step thread)."""

    def rollback(self) -> None:
        """Drops whatever the prepare in flight did; the layers not yet committed keep the
        weights ``old`` routes to."""


@runtime_checkable
class ChunkedApplier(Applier, Protocol):
    """An applier that switches a version in chunks of layers: ``prepare`` prepares chunk 0
    and sets ``chunks`` (the layers of each chunk, the same on every rank), each ``commit``
    makes one chunk live, ``prepare_next`` prepares the chunk after the last committed one.
    ``Rollout`` tells one apart by these two members (``isinstance``), once, at construction."""

    chunks: tuple[tuple[int, ...], ...]

    def prepare_next(self) -> None:
        """Prepares the chunk after the last committed one (on the rollout's worker)."""


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
        restored=sum(r.restored for r in reports),
        restored_bytes=sum(r.restored_bytes for r in reports),
    )


@dataclass(frozen=True)
class Local:
    """One rank's side of a rollout at a step boundary.

    ``current``: version routed with now; ``offered``: newest version this rank has and would
    prepare (``current`` if none); ``target``: version being prepared (0: none; ``current``
    while moving the switched layers of an aborted version back); ``prepared``: the target's
    prepare (of its chunk ``chunk``) finished; ``failed``: why the target's prepare failed (""
    if not); ``final``: ``chunk`` is the target's last; ``revert``: nothing in flight, but
    layers of an aborted version switched here and wait to be moved back; ``local``: the
    target is a survivor placement this rank computed (not a service version: never acked).
    """

    current: int
    offered: int
    target: int
    prepared: bool
    failed: str
    chunk: int = 0
    final: bool = True
    revert: bool = False
    local: bool = False


@dataclass(frozen=True)
class Decision:
    """What the ranks agreed at a step boundary: start preparing ``start`` (0: nothing to
    start; the current version: move an aborted version's switched layers back), ``switch``
    to the target (its current chunk's layers) from this step on, ``abort`` it, or ``hold``
    its last switch (it is ready; another deployment of a ``RolloutGroup`` is changing)."""

    start: int = 0
    switch: bool = False
    abort: bool = False
    hold: bool = False  # ready, but the last switch waits for another deployment (RolloutGroup)


class Barrier(Protocol):
    chunked: bool  # agrees a switch step per chunk (else: whole versions only)

    def sync(self, step: int, local: Local) -> Decision:
        """Called by every rank at every step boundary; returns the agreed decision."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutEvent:
    """A rollout that ended: ``kind`` is ``"switched"``, ``"adopted"`` (the service's survivor
    placement of the local one's pair: its number taken, nothing moved), ``"failed"`` (this rank's prepare) or
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
        (reduced,) = self.reduce([local])
        decision = self.decide(local, reduced)
        self.report(step, local, decision)
        return decision

    def reduce(self, locals_: Sequence[Local]) -> list[list[int]]:
        """One all-reduce (MAX) of every ``Local``'s twelve values: what ``decide`` reads, per local."""
        values = []
        for local in locals_:
            # current too: after a local survivor placement a rank may relabel (or adopt) at
            # another step than its peers, and a start needs every rank to move from one version.
            pairs = (local.offered, local.target, local.chunk, int(local.revert), local.current)
            values += [v for x in pairs for v in (x, -x)]
            values += [int(local.target > 0 and not local.prepared), int(bool(local.failed))]
        t = self._torch.tensor(values, dtype=self._torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        v = [int(x) for x in t.tolist()]
        return [v[i : i + 12] for i in range(0, len(v), 12)]

    @staticmethod
    def decide(local: Local, v: Sequence[int]) -> Decision:
        """The decision every rank draws from the same reduced values ``v`` (no side effects)."""
        (max_offered, min_offered), (max_target, min_target), (max_chunk, min_chunk), (max_revert, min_revert) = (
            (v[i], -v[i + 1]) for i in range(0, 8, 2)
        )
        max_current, min_current = v[8], -v[9]
        not_ready, failed = v[10], v[11]
        if max_target == 0:
            if max_revert:  # layers of an aborted version to move back: once every rank rolled back
                return Decision(start=local.current) if min_revert else Decision()
            if min_offered == max_offered and min_current == max_current and min_offered > local.current:
                return Decision(start=min_offered)
            return Decision()
        if failed or min_target != max_target or min_chunk != max_chunk:
            return Decision(abort=True)
        return Decision(switch=True) if not_ready == 0 else Decision()

    def report(self, step: int, local: Local, decision: Decision) -> None:
        """Acks what was decided (after any coupling of deployments): FAILED with this rank's
        error, SWITCHED after a version's last chunk; moving layers back is not acked (acks are
        about versions, not about reverts)."""
        if self.acks is None or local.target in (0, local.current) or local.local:
            return
        if decision.abort and local.failed and self._failed_sent != local.target:
            self._failed_sent = local.target
            self.acks.send(local.target, "failed", step, local.failed)
        elif decision.switch and local.final:
            self.acks.send(local.target, "switched", step)

    def close(self) -> None:
        if self.acks is not None:
            self.acks.close()


class RolloutGroup:
    """Rollouts of several deployments on the same ranks, agreed by one all-reduce a step: a
    target model and its draft (MTP, speculative decoding), each with its own experts, slots,
    loads and versions. Each rollout keeps its own ``ProcessGroupBarrier`` (for its acks; all
    on one group) and applier; the service keeps nothing across them.

    Each deployment starts, prepares, switches chunks and aborts as on its own, with one rule
    joining them: **a version's last switch waits while another deployment is changing** (a
    version in flight, agreed to start, or offered on some rank), and then both switch at the
    same step. So when both change they switch together; when one changes alone it switches
    alone; when one fails, the other goes on. A deployment kept waiting so does not time out
    for it (its wait restarts); a version offered on some ranks but never reaching the others
    keeps the other deployment waiting, as it would keep its own from starting.
    """

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        if not rollouts:
            raise ValueError("a RolloutGroup needs at least one rollout")
        barriers = [r.barrier for r in rollouts]
        if not all(isinstance(b, ProcessGroupBarrier) for b in barriers):
            kinds = sorted({type(b).__name__ for b in barriers})
            raise ValueError(
                f"a RolloutGroup agrees its switches through the engine's process group: every rollout needs a "
                f"ProcessGroupBarrier, got {', '.join(kinds)}"
            )
        if any(b.group is not barriers[0].group for b in barriers):
            raise ValueError("every rollout of a RolloutGroup needs its ProcessGroupBarrier on the same group")
        if len({id(b) for b in barriers}) != len(barriers):
            raise ValueError("each rollout of a RolloutGroup needs a ProcessGroupBarrier of its own (its acks)")
        self.rollouts = tuple(rollouts)

    def step(self, step: int) -> list[PublishedPlacement]:
        """At a step boundary: advances every rollout; returns each one's placement to route with."""
        locals_ = [r._local() for r in self.rollouts]
        barriers = [r.barrier for r in self.rollouts]
        reduced = barriers[0].reduce(locals_)
        decisions = [ProcessGroupBarrier.decide(local, v) for local, v in zip(locals_, reduced)]
        decisions = _together(decisions, locals_, reduced)
        for barrier, local, decision in zip(barriers, locals_, decisions):
            barrier.report(step, local, decision)
        return [r._apply(step, d) for r, d in zip(self.rollouts, decisions)]

    def close(self, timeout_s: float = 2.0) -> None:
        for rollout in self.rollouts:
            rollout.close(timeout_s)


def _together(decisions: list[Decision], locals_: list[Local], reduced: list[list[int]]) -> list[Decision]:
    """``RolloutGroup``'s rule: a last switch holds while another deployment is changing and
    not switching its own last chunk at this step. Drawn from the reduced values and the agreed
    decisions only, so every rank holds alike."""
    finishing = [d.switch and local.final for d, local in zip(decisions, locals_)]
    changing = [v[2] > 0 or d.start != 0 or v[0] > local.current for d, local, v in zip(decisions, locals_, reduced)]
    out = []
    for i, decision in enumerate(decisions):
        held = finishing[i] and any(changing[j] and not finishing[j] for j in range(len(decisions)) if j != i)
        out.append(Decision(hold=True) if held else decision)
    return out


class Phase(enum.Enum):
    """Where one rank's rollout stands between two step boundaries (``Rollout.phase``).

    ``IDLE``: nothing in flight (the routing map is ``current``'s, or mixed after a failed move
    back); ``PREPARING``: the worker prepares the transition's current chunk; ``READY``: it
    prepared, the rank waits for the others; ``FAILED``: the prepare raised or timed out, the
    rank waits for the agreed abort (and for a timed-out prepare to return); ``REVERTING``: an
    aborted version's switched layers wait for every rank to roll back, then move back. The
    switch itself (``commit`` at the agreed step) runs inline on the step thread: an edge, not
    a phase.
    """

    IDLE = "idle"
    PREPARING = "preparing"
    READY = "ready"
    FAILED = "failed"
    REVERTING = "reverting"


# Every change of phase, and what makes it (``Rollout._enter`` refuses any other):
#   IDLE, REVERTING -> PREPARING  the barrier agreed to start (a version, or the move back)
#   PREPARING -> READY            the prepare's future returned (read once, at a step boundary)
#   PREPARING -> FAILED           it raised, or ran past timeout_s
#   READY -> FAILED               the other ranks were not ready within timeout_s
#   READY -> PREPARING            a chunk switched; the next chunk's prepare starts
#   READY -> IDLE                 the last chunk switched
#   READY, FAILED -> IDLE         aborted (nothing switched, or the move back failed: "partial")
#   PREPARING -> IDLE             closed: the prepare returned within close()'s wait, rolled back
#   READY, FAILED -> REVERTING    aborted after chunks switched: they wait to be moved back
#   PREPARING, READY, FAILED, REVERTING -> IDLE   a rank died (regroup): dropped on this rank
_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.PREPARING}),
    Phase.REVERTING: frozenset({Phase.PREPARING, Phase.IDLE}),
    Phase.PREPARING: frozenset({Phase.READY, Phase.FAILED, Phase.IDLE}),
    Phase.READY: frozenset({Phase.FAILED, Phase.PREPARING, Phase.IDLE, Phase.REVERTING}),
    Phase.FAILED: frozenset({Phase.IDLE, Phase.REVERTING}),
}


@dataclass
class _Transition:
    """The move in flight (one chunk prepared at a time), written by the step thread only: the
    worker's outcome comes back through ``future``, read once."""

    published: PublishedPlacement
    revert: bool  # moving an aborted version's switched layers back to ``published``
    future: futures.Future
    started: float  # this chunk's prepare
    chunks: tuple[tuple[int, ...], ...] = ()  # known once chunk 0 is prepared
    chunk: int = 0
    seconds: float = 0.0  # this chunk's prepare, once read
    ready_at: float = 0.0  # when it returned, once read
    wait_from: float = 0.0  # the wait for the other ranks runs from here (ready_at, or the last hold)
    error: str = ""
    total_prepare: float = 0.0  # over the chunks switched so far
    total_wait: float = 0.0

    @property
    def final(self) -> bool:
        return not self.chunks or self.chunk == len(self.chunks) - 1


def _may_be_services_plan_of(local: PublishedPlacement, offered: PublishedPlacement | None) -> bool:
    """Whether ``offered``, a service version that came before the local survivor placement
    ``local`` was taken up, is to be resolved against it (``Rollout._resolve_local``) rather
    than dropped: newer than its base, and counting at least its down ranks."""
    return (
        offered is not None and offered.version > local.survivor_of and set(local.down_ranks) <= set(offered.down_ranks)
    )


class Rollout:
    """One rank's rollout of published placements; ``step(step)`` at every step boundary.

    ``initial``: the placement routed with now. ``timeout_s`` bounds a chunk's prepare plus
    the wait for the other ranks. ``on_event(RolloutEvent)`` runs on the step thread after a
    switch, failure or abort. ``on_switch(step, layers, routing)`` runs on the step thread at
    every switch, after the weights of ``layers`` are in place: from ``step`` on those layers
    route with ``routing`` (a whole ``eplb.Placement``; write its rows ``layers`` into the
    engine's maps, e.g. ``apply_to_vllm(state, routing, layers=layers)``). ``current`` is the
    last version switched everywhere; ``routing`` the map to route with (``current``'s, but
    mixed while a chunked version is half switched: ``mixed``); ``phase`` where it stands.

    The prepares run on a one-worker executor of the rollout's own, one at a time; the worker
    writes no state: the step thread reads each prepare's outcome from its future, once.
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
        self._chunked = isinstance(applier, ChunkedApplier)
        self._lock = threading.Lock()  # offer() runs on the watcher's thread
        self._offered: PublishedPlacement | None = None
        self._refused = 0  # a version that failed here is not prepared again
        # A survivor placement computed on this rank (offer(..., supersede=True)) is known by its
        # (base version, down ranks), not by its number: the service may publish another plan
        # under the same number. While it is offered or routed, the service's versions wait in
        # _from_service for the step thread (_resolve_local): its own survivor plan of the same
        # pair is adopted without a move, any other newer than the base is rolled out.
        self._local_plan: PublishedPlacement | None = None
        self._local_base: PublishedPlacement | None = None
        self._from_service: PublishedPlacement | None = None
        self._phase = Phase.IDLE
        self._move: _Transition | None = None
        self._routed = initial
        self._executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb-prepare")

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def switch_target(self) -> PublishedPlacement | None:
        """The version the transition in flight heads to (a revert's too), or None when idle:
        what a chunked switch's adapter draws its static tables over (SGLang's chunked update
        copies the target's rows)."""
        move = self._move
        return move.published if move is not None else None

    @property
    def mixed(self) -> bool:
        """Some layers route with a version other than ``current`` (between chunks)."""
        return self.routing is not self.current.placement

    def offer(self, published: PublishedPlacement, *, supersede: bool = False) -> None:
        """Hands over a new version (e.g. as ``PlacementWatcher``'s callback); the latest wins.
        ``supersede``: this one wins over any version offered before, and over an earlier
        refusal of its number (a survivor placement computed on the rank after a death: the
        versions offered before it count the dead rank)."""
        with self._lock:
            if supersede and published.version > self.current.version:
                self._take_local(published, self.current, offered=published)
            elif self._local_plan is not None:
                if published.version > max(self._local_plan.survivor_of, getattr(self._from_service, "version", 0)):
                    self._from_service = published
            elif published.version > max(self.current.version, self._offered.version if self._offered else 0):
                self._offered = published

    def route_moved(self, published: PublishedPlacement, base: PublishedPlacement) -> None:
        """Routes ``published``, a survivor placement computed on this rank, from now on, its
        weights already moved outside the rollout (every live rank at one agreed step, as when a
        restarted rank is planned in again: the rollout has no way in for a rank that was not
        there). It is then known by (``base``'s version, its down ranks), as a survivor placement
        offered with ``supersede`` is once switched: the service's own plan of that pair is
        adopted without a move, any other newer version is rolled out from it. A version
        offered before, as ``offer(supersede=True)`` treats it: newer than the base and counting
        at least ``published``'s down ranks (the service's plan of the pair may come first), it
        waits to be resolved so; otherwise it is dropped (it counted the ranks as they were).
        Only between transitions (``RuntimeError`` otherwise); call it on the step thread."""
        if self._phase is not Phase.IDLE:
            raise RuntimeError(f"route_moved needs an idle rollout, this one is {self._phase.value}")
        with self._lock:
            self._take_local(published, base, offered=None)
        self.current, self.routing, self._routed = published, published.placement, published

    def _take_local(
        self, published: PublishedPlacement, base: PublishedPlacement, offered: PublishedPlacement | None
    ) -> None:
        """Under ``_lock``: ``published`` becomes the local survivor placement of ``base``,
        ``offered`` the version offered (``published`` to be rolled out, or None: routed already),
        and an earlier refusal of its number is forgotten. The service's own survivor plan of
        these down ranks may have come first (the watcher can deliver it before this rank's
        ranks_down runs, the SetRanksDown being a faster peer's): dropping it would leave this
        rank on the local number while the others take the service's, and no start is ever
        agreed; so a version offered before is kept for ``_resolve_local`` where it may be that
        plan, and dropped otherwise (it counted the ranks as they were)."""
        before, self._offered = self._offered, offered
        self._refused = min(self._refused, published.version - 1)
        self._local_plan, self._local_base = published, base
        self._from_service = before if _may_be_services_plan_of(published, before) else None

    @property
    def local_survivor(self) -> PublishedPlacement | None:
        """The survivor placement this rank computed, while it is offered or routed and no
        service version has replaced it (its number is only this rank's)."""
        return self._local_plan

    def step(self, step: int) -> PublishedPlacement:
        """At a step boundary: advances the rollout and returns the placement to route with
        from this step on: ``current``, or, while ``mixed``, ``current`` with ``placement``
        replaced by ``routing`` (its version is still ``current``'s)."""
        return self._apply(step, self.barrier.sync(step, self._local()))

    def _local(self) -> Local:
        """This rank's side at this step boundary: reads a finished prepare's outcome and
        checks the timeouts first (``PREPARING``/``READY`` -> ``READY``/``FAILED``)."""
        self._poll(time.monotonic())
        self._resolve_local()
        with self._lock:
            offered = (
                self._offered.version
                if self._offered and self._offered.version > self._refused
                else self.current.version
            )
        move, phase = self._move, self._phase
        if move is None:
            return Local(self.current.version, offered, 0, False, "", revert=phase is Phase.REVERTING)
        return Local(
            self.current.version,
            offered,
            move.published.version,
            phase is Phase.READY,
            move.error if phase is Phase.FAILED else "",
            move.chunk,
            move.final,
            local=move.published is self._local_plan,
        )

    def _resolve_local(self) -> None:
        """The step thread's answer to a service version that came while a local survivor
        placement is offered or routed (only between transitions, so none is cut short).

        The service's survivor plan of the same (base version, down ranks), the same map
        (``survivors.same_survivor``): routed already, it is adopted (its number, no move, acked
        as switched); still only offered, it takes the local one's place. Any other version
        newer than the base (a normal plan under the same number, say): the local plan is
        dropped and that version rolled out as usual; if the local map is routed, ``current``
        goes back to the base (the local plan was never a service version) with the local map
        still routed (``mixed``), so the move starts from what the rank holds."""
        from .survivors import same_survivor

        if self._phase is not Phase.IDLE:
            return
        with self._lock:
            local, got, base = self._local_plan, self._from_service, self._local_base
            if local is None or got is None:
                return
            self._local_plan = self._local_base = self._from_service = None
            routed = self.current is local
            if not same_survivor(local, got):
                self._offered = got
                if routed:
                    self.current = base
                    self._routed = replace(base, placement=self.routing)
                return
            if not routed:
                self._offered = got
                return
            self._offered = got
        self.current, self.routing, self._routed = got, got.placement, got
        acks = getattr(self.barrier, "acks", None)
        if acks is not None:
            acks.send(got.version, "switched")
        self._event(RolloutEvent("adopted", got.version, -1, 0.0, 0.0))

    def _apply(self, step: int, decision: Decision) -> PublishedPlacement:
        """Carries out what the ranks agreed at this step boundary; returns the map to route with."""
        phase, move = self._phase, self._move
        if decision.start and phase is Phase.REVERTING:
            if decision.start == self.current.version:
                self._start(self.current, revert=True)
        elif decision.start and phase is Phase.IDLE:
            with self._lock:
                target = self._offered
            if target is not None and target.version == decision.start:
                self._start(target)
        elif decision.switch and phase is Phase.READY:
            self._switch(move, step)
        elif decision.hold and phase is Phase.READY:
            move.wait_from = time.monotonic()  # waiting for another deployment, not for the ranks
        elif decision.abort and phase in (Phase.READY, Phase.FAILED) and move.future.done():
            # (a timed-out prepare still running is rolled back once it returns)
            self._abort(move, step)
        return self._routed

    # -- transitions ----------------------------------------------------------------------

    def _enter(self, phase: Phase) -> None:
        """The one place the phase changes."""
        if phase not in _TRANSITIONS[self._phase]:
            raise RuntimeError(f"rollout cannot go from {self._phase.value} to {phase.value}")
        self._phase = phase

    def _poll(self, now: float) -> None:
        move = self._move
        if move is None:
            return
        if self._phase is Phase.PREPARING:
            if move.future.done():
                self._read(move, now)
                self._enter(Phase.FAILED if move.error else Phase.READY)
            elif now - move.started > self.timeout_s:
                move.error = f"prepare of version {move.published.version} timed out after {self.timeout_s:g} s"
                self._enter(Phase.FAILED)
        elif self._phase is Phase.READY and now - move.wait_from > self.timeout_s:
            move.error = f"version {move.published.version}: other ranks not ready {self.timeout_s:g} s after this one"
            self._enter(Phase.FAILED)
        elif self._phase is Phase.FAILED and not move.ready_at and move.future.done():
            self._read(move, now)  # a timed-out prepare returned: its own outcome no longer matters

    def _read(self, move: _Transition, now: float) -> None:
        """The prepare's outcome, read once: its chunks and finishing time, or its error."""
        try:
            chunks, finished = move.future.result()
        except GroupMismatch as exc:
            # Expected after a death (a version planned for the whole group reaching the
            # survivors' one): refused and rolled back, no traceback for an operator to chase.
            log.warning("version %d refused by this rank's mover group: %s", move.published.version, exc)
            move.error = move.error or f"{type(exc).__name__}: {exc}"
            finished = now
        except Exception as exc:  # reported through the barrier, then rolled back
            log.error("preparing version %d failed", move.published.version, exc_info=exc)
            move.error = move.error or f"{type(exc).__name__}: {exc}"
            finished = now
        else:
            if chunks is not None:
                move.chunks = chunks
        move.seconds, move.ready_at, move.wait_from = finished - move.started, finished, finished

    def _start(self, target: PublishedPlacement, revert: bool = False) -> None:
        old, new = self.routing, target.placement
        future = self._executor.submit(self._prepare_first, old, new, target.version)
        self._move = _Transition(target, revert, future, time.monotonic())
        self._enter(Phase.PREPARING)

    def _prepare_first(
        self, old: eplb.Placement, new: eplb.Placement, version: int
    ) -> tuple[tuple[tuple[int, ...], ...], float]:
        """On the worker: chunk 0 (the applier cuts the chunks); returns them and the time it ended."""
        self.applier.prepare(old, new)
        whole = (tuple(range(new.topology.num_layers)),)
        chunks = (tuple(tuple(c) for c in self.applier.chunks) or whole) if self._chunked else whole
        if len(chunks) > 1 and not self.barrier.chunked:
            raise ValueError(
                f"version {version} needs {len(chunks)} chunks under the applier's staging budget, and "
                f"{type(self.barrier).__name__} switches whole versions only: raise the applier's staging_bytes "
                f"(None: every incoming expert at once) or use ProcessGroupBarrier"
            )
        return chunks, time.monotonic()

    def _prepare_next(self) -> tuple[None, float]:
        """On the worker: the chunk after the last committed one."""
        self.applier.prepare_next()
        return None, time.monotonic()

    def _switch(self, move: _Transition, step: int) -> None:
        layers = move.chunks[move.chunk]
        self.applier.commit()
        now = time.monotonic()
        move.total_prepare += move.seconds
        move.total_wait += now - move.ready_at
        last = move.final
        if last:  # the chunks cover every layer: the routing map is the target's
            if not move.revert:
                self.current = move.published
                if move.published is not self._local_plan:
                    with self._lock:  # a service version replaced the local survivor placement
                        self._local_plan = self._local_base = self._from_service = None
            self.routing = self.current.placement
        else:
            target = move.published.placement
            rows = self.routing.phy2log.copy()
            rows[list(layers)] = target.phy2log[list(layers)]
            self.routing = eplb.Placement(rows, target.topology)
        self._routed = self.current if not self.mixed else replace(self.current, placement=self.routing)
        if self.on_switch is not None:
            self.on_switch(step, layers, self.routing)
        if not last:
            move.chunk += 1
            move.future, move.started, move.seconds, move.ready_at = (
                self._executor.submit(self._prepare_next),
                time.monotonic(),
                0.0,
                0.0,
            )
            self._enter(Phase.PREPARING)
            return
        self._move = None
        self._enter(Phase.IDLE)
        self._event(
            RolloutEvent(
                "reverted" if move.revert else "switched",
                move.published.version,
                step,
                move.total_prepare,
                move.total_wait,
                chunks=len(move.chunks),
            )
        )

    def _abort(self, move: _Transition, step: int) -> None:
        self.applier.rollback()
        self._move = None
        seconds = move.total_prepare + move.seconds
        waited = move.total_wait + (time.monotonic() - move.ready_at if move.ready_at else 0.0)
        if move.revert:  # moving back failed: the layers switched so far stay as they are
            self._enter(Phase.IDLE)
            self._routed = self.current if not self.mixed else replace(self.current, placement=self.routing)
            log.error("moving version %d's switched layers back failed: routing stays mixed", move.published.version)
            self._event(
                RolloutEvent(
                    "partial",
                    move.published.version,
                    step,
                    seconds,
                    waited,
                    move.error or "another rank failed",
                    chunks=move.chunk,
                )
            )
            return
        with self._lock:  # an aborted version is not prepared again; a newer one may be
            self._refused = max(self._refused, move.published.version)
        self._enter(Phase.REVERTING if self.mixed else Phase.IDLE)
        self._event(
            RolloutEvent(
                "failed" if move.error else "aborted",
                move.published.version,
                step,
                seconds,
                waited,
                move.error,
                chunks=move.chunk,
            )
        )

    def regroup(self, barrier: Barrier, timeout_s: float = 30.0) -> None:
        """A rank died: from now on agree through ``barrier`` (over the survivors' group; the
        applier's group is the caller's to replace). A transition in flight is dropped on this
        rank alone, without the barrier (every survivor does the same when it learns of the
        death): its prepare is waited for up to ``timeout_s`` (its transfers fail or finish
        once the peer is gone) and rolled back; layers of it already switched stay switched
        (``routing`` is then mixed, and the next transition moves from it). Call it on the step
        thread, between two ``step()`` calls, on every survivor, then ``offer`` the survivor
        placement (``eplb_engine.survivors.survivor_plan``)."""
        move = self._move
        if move is not None:
            futures.wait([move.future], timeout=timeout_s)
            if not move.future.done():
                raise RuntimeError(
                    f"the prepare of version {move.published.version} did not return within {timeout_s:g} s of the "
                    "rank's death; its transfers still wait on the dead peer (abort the old group first)"
                )
            with contextlib.suppress(Exception):  # its outcome no longer matters, only that it ended
                move.future.result()
            self.applier.rollback()
            self._move = None
            self._enter(Phase.IDLE)
            self._routed = self.current if not self.mixed else replace(self.current, placement=self.routing)
            self._event(
                RolloutEvent("aborted", move.published.version, -1, move.seconds, 0.0, "a rank died", chunks=move.chunk)
            )
        elif self._phase is Phase.REVERTING:
            self._enter(Phase.IDLE)  # the survivor placement moves from the mixed map instead
        old, self.barrier = self.barrier, barrier
        with contextlib.suppress(Exception):
            old.close()

    def _event(self, event: RolloutEvent) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def close(self, timeout_s: float = 2.0, *, close_barrier: bool = True) -> None:
        """Waits up to ``timeout_s`` for a prepare in flight (its transfers are collective: peers
        closing at the same step finish theirs) and rolls it back, then closes the barrier
        (unless ``close_barrier`` is False: a barrier shared with other rollouts)."""
        move = self._move
        if move is not None:
            futures.wait([move.future], timeout=timeout_s)
            if move.future.done():
                self.applier.rollback()
                self._move = None
                self._enter(Phase.IDLE)
        self._executor.shutdown(wait=False)
        if close_barrier:
            self.barrier.close()

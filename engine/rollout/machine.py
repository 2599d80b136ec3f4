"""One rank's rollout as a phase machine: ``Rollout``, its ``Phase`` and the transitions
between them (``_TRANSITIONS``; ``Rollout._enter`` is the only place the phase changes).

The machine takes the next version from its ``VersionIntake`` (offers, supersede rules and
local survivor plans live there), asks its ``Barrier`` at every step boundary what the ranks
agreed, and carries it out with its ``Applier``: start a prepare on its worker, switch a
chunk at the agreed step, abort, move switched layers back.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, replace

import eplb

from ..survivors import GroupMismatch
from ..wire import PublishedPlacement
from .appliers import Applier, ChunkedApplier
from .barriers import Barrier, Decision, Local
from .intake import Resolve, VersionIntake

__all__ = ["Phase", "Rollout", "RolloutEvent"]

# The rollout logs under one name, eplb_engine.rollout, whichever of its modules speaks.
log = logging.getLogger(__package__)


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
    # Started from a rebased local survivor plan: (that plan, its base), what the rank goes
    # back to if the move is given up (Rollout._give_up_rebase); None otherwise.
    rebased: tuple[PublishedPlacement, PublishedPlacement] | None = None
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
        # Offers, refusals and local survivor plans: the machine only asks it for the next version.
        self._intake = VersionIntake(lambda: self.current)
        self._phase = Phase.IDLE
        self._move: _Transition | None = None
        self._routed = initial
        # (local survivor plan, its base) while rebased (_resolve_local): current is the base but
        # the rank routes the plan; the next transition takes it along (_Transition.rebased).
        self._rebased: tuple[PublishedPlacement, PublishedPlacement] | None = None
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
        self._intake.offer(published, supersede=supersede)

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
        self._intake.take_routed(published, base)
        self.current, self.routing, self._routed = published, published.placement, published
        self._rebased = None

    @property
    def local_survivor(self) -> PublishedPlacement | None:
        """The survivor placement this rank computed, while it is offered or routed and no
        service version has replaced it (its number is only this rank's)."""
        return self._intake.local_survivor

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
        following = self._intake.next_version()
        offered = following.version if following is not None else self.current.version
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
            local=self._intake.is_local(move.published),
        )

    def _resolve_local(self) -> None:
        """Applies the intake's resolution of a service version against the local survivor
        placement (``VersionIntake.resolving``), only between transitions, so none is cut short:
        rebased, ``current`` goes back to the base (the local plan was never a service version)
        with the local map still routed (``mixed``), so the move to the service's version starts
        from what the rank holds (and, given up, ends there: ``_give_up_rebase``); adopted, the
        service's version is routed under its number, moving nothing (acked as switched)."""
        if self._phase is not Phase.IDLE:
            return
        with self._intake.resolving() as resolution:
            if resolution is not None and resolution.kind is Resolve.REBASE:
                self._rebased = (self.current, resolution.base)  # current is the local plan here
                self.current = resolution.base
                self._routed = replace(resolution.base, placement=self.routing)
        if resolution is None or resolution.kind is not Resolve.ADOPT:
            return
        got = resolution.version
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
            # The version this rank offered the barrier in _local() (the same question, asked
            # again): one offered since is newer than decision.start and waits for the next boundary.
            target = self._intake.next_version()
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
        rebased, self._rebased = (None, self._rebased) if revert else (self._rebased, None)
        self._move = _Transition(target, revert, future, time.monotonic(), rebased=rebased)
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
                self._intake.switched(move.published)
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
        self._intake.refuse(move.published.version)  # not prepared again; a newer one may be
        if move.rebased is not None:
            # The move started from a rebased local survivor plan: "back" is that plan (the map
            # the weights held), not current (its base, the map from before the death). Layers
            # switched so far are moved back to it by the REVERTING below.
            self._give_up_rebase(move.rebased)
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

    def _give_up_rebase(self, rebased: tuple[PublishedPlacement, PublishedPlacement]) -> None:
        """A move from a rebased local survivor plan (``_resolve_local``) was given up (failed,
        aborted, or dropped by a regroup): the rank is back on that plan, as ``route_moved``
        left it: ``current`` is the plan (known by its base and down ranks, the intake's local
        plan again, so a later service version resolves against it); ``routing`` is its map,
        or mixed with the layers of the given-up version switched so far."""
        local, base = rebased
        # The intake first: an offer on the watcher's thread in between goes to the local plan.
        self._intake.rebase_given_up(local, base)
        self.current = local
        self._routed = self.current if not self.mixed else replace(self.current, placement=self.routing)

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
        # Rebased on a local survivor plan, with or without the move from it in flight: the
        # rank goes back to that plan (survivor placements are computed from current, and the
        # base counts the ranks that died before).
        rebased = move.rebased if move is not None else self._rebased
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
        if rebased is not None:
            self._rebased = None
            self._give_up_rebase(rebased)
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

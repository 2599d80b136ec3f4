"""Which version a rank's rollout moves to next: ``VersionIntake``.

Versions reach a rank two ways. The service publishes them (the watcher's ``offer``, on its own
thread; the latest wins). And after ranks go down a rank computes a survivor placement itself
(``offer(..., supersede=True)``; or ``take_routed`` when the ranks already moved its weights
outside the rollout). Such a local plan's number (base + 1) is only this rank's: the service
may publish another plan under the same number, so a local plan is known by its (base version,
down ranks), and while it is offered or routed the service's versions wait for the step thread
(``resolving``): the service's own survivor plan of that pair is adopted without a move, any other
version newer than the base is rolled out.

The intake keeps all of that (the newest offer, the refused mark, the local plan, its base, the
service version waiting for it) behind one lock, apart from the phase machine, and answers the
machine one question, ``next_version()``: what to roll out next, if anything. The machine tells
it what happened to what it rolled out (``switched``, ``refuse``) and applies what a resolution
asks of it (``resolving``, a ``Resolution``).
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..survivors import same_survivor
from ..wire import PublishedPlacement

__all__ = ["Resolution", "Resolve", "VersionIntake"]


class Resolve(enum.Enum):
    """What the machine does about a service version resolved against the local plan."""

    OFFER = "offer"  # the local plan was only offered: the service's version takes its place, nothing else
    REBASE = "rebase"  # routed, another plan: ``current`` back to the base, rolled out from the local map
    ADOPT = "adopt"  # routed, the service's plan of the same pair and map: its number taken, nothing moved


@dataclass(frozen=True)
class Resolution:
    """A service version resolved against the local survivor plan (``VersionIntake.resolving``):
    the intake has already made ``version`` its next version and forgotten the local plan;
    ``kind`` says what the machine still does (``base``: the local plan's base, which a
    ``REBASE`` makes ``current`` again, inside the ``resolving`` block)."""

    kind: Resolve
    version: PublishedPlacement
    base: PublishedPlacement


def _may_be_services_plan_of(local: PublishedPlacement, offered: PublishedPlacement | None) -> bool:
    """Whether ``offered``, a service version that came before the local survivor placement
    ``local`` was taken up, is to be resolved against it (``VersionIntake.resolving``) rather
    than dropped: newer than its base, and counting at least its down ranks."""
    return (
        offered is not None and offered.version > local.survivor_of and set(local.down_ranks) <= set(offered.down_ranks)
    )


class VersionIntake:
    """One rank's versions on their way in: the offers, the refusals and the local survivor
    plan; ``next_version()`` is the one the machine rolls out next.

    ``current`` reads the version the machine routes with now (``Rollout.current``, which the
    machine owns): an offer no newer than it is dropped, and a local plan offered with
    ``supersede`` is a survivor of it. ``offer`` may run on any thread (the watcher's); the
    rest runs on the step thread.
    """

    def __init__(self, current: Callable[[], PublishedPlacement]) -> None:
        self._current = current
        self._lock = threading.Lock()  # offer() runs on the watcher's thread
        self._offered: PublishedPlacement | None = None
        self._refused = 0  # a version that failed here is not prepared again
        # A survivor placement computed on this rank is known by its (base version, down ranks),
        # not by its number: the service may publish another plan under the same number. While it
        # is offered or routed, the service's versions wait in _from_service for resolving().
        self._local_plan: PublishedPlacement | None = None
        self._local_base: PublishedPlacement | None = None
        self._from_service: PublishedPlacement | None = None

    # -- what comes in ----------------------------------------------------------------------

    def offer(self, published: PublishedPlacement, *, supersede: bool = False) -> None:
        """A new version; the latest wins. ``supersede``: this one wins over any version
        offered before, and over an earlier refusal of its number (a survivor placement
        computed on the rank after a death: the versions offered before it count the dead
        rank). While a local plan is offered or routed, a service version newer than its base
        waits for ``resolving`` instead."""
        with self._lock:
            current = self._current()
            if supersede and published.version > current.version:
                self._take_local(published, current, offered=published)
            elif self._local_plan is not None:
                # (a version refused here, the one a rebased move failed on, is not resolved again)
                newest = max(self._local_plan.survivor_of, self._refused, getattr(self._from_service, "version", 0))
                if published.version > newest:
                    self._from_service = published
            elif published.version > max(current.version, self._offered.version if self._offered else 0):
                self._offered = published

    def take_routed(self, published: PublishedPlacement, base: PublishedPlacement) -> None:
        """``published``, a survivor placement of ``base`` computed on this rank, is routed from
        now on, its weights moved outside the rollout (``Rollout.route_moved``): it is the local
        plan, with nothing left to roll out for it."""
        with self._lock:
            self._take_local(published, base, offered=None)

    def _take_local(
        self, published: PublishedPlacement, base: PublishedPlacement, offered: PublishedPlacement | None
    ) -> None:
        """Under ``_lock``: ``published`` becomes the local survivor placement of ``base``,
        ``offered`` the version offered (``published`` to be rolled out, or None: routed already),
        and an earlier refusal of its number is forgotten. The service's own survivor plan of
        these down ranks may have come first (the watcher can deliver it before this rank's
        ranks_down runs, the SetRanksDown being a faster peer's): dropping it would leave this
        rank on the local number while the others take the service's, and no start is ever
        agreed; so a version offered before is kept for ``resolving`` where it may be that
        plan, and dropped otherwise (it counted the ranks as they were)."""
        before, self._offered = self._offered, offered
        self._refused = min(self._refused, published.version - 1)
        self._local_plan, self._local_base = published, base
        self._from_service = before if _may_be_services_plan_of(published, before) else None

    # -- what the machine asks --------------------------------------------------------------

    def next_version(self) -> PublishedPlacement | None:
        """The version to roll out next: the newest offered, unless it was refused here (None:
        nothing; the machine offers its ``current`` to the barrier then, which starts nothing)."""
        with self._lock:
            offered = self._offered
            return offered if offered is not None and offered.version > self._refused else None

    @property
    def local_survivor(self) -> PublishedPlacement | None:
        """The survivor placement this rank computed, while it is offered or routed and no
        service version has replaced it (its number is only this rank's)."""
        return self._local_plan

    def is_local(self, published: PublishedPlacement) -> bool:
        """Whether ``published`` is the local survivor plan (no service version: never acked)."""
        return published is self._local_plan

    @contextlib.contextmanager
    def resolving(self) -> Iterator[Resolution | None]:
        """A service version that came while a local survivor placement is offered or routed,
        resolved against it (None: nothing to resolve); the machine enters it between
        transitions only (so none is cut short) and applies a ``REBASE`` inside the block,
        under the intake's lock, where ``offer`` reads ``current``: no offer sees the local
        plan forgotten and its number still current.

        The service's survivor plan of the same (base version, down ranks), the same map
        (``survivors.same_survivor``): routed already, it is adopted (``ADOPT``); still only
        offered, it takes the local one's place (``OFFER``). Any other version newer than the
        base (a normal plan under the same number, say) replaces the local plan as the next
        version; if the local map is routed, ``current`` goes back to the base (``REBASE``:
        the local plan was never a service version), so the move starts from what the rank
        holds."""
        with self._lock:
            yield self._resolve()

    def _resolve(self) -> Resolution | None:
        """Under ``_lock``: ``resolving``'s answer; the local plan is forgotten once resolved."""
        local, got, base = self._local_plan, self._from_service, self._local_base
        if local is None or got is None or base is None:
            return None
        self._local_plan = self._local_base = self._from_service = None
        self._offered = got
        routed = self._current() is local
        if not same_survivor(local, got):
            return Resolution(Resolve.REBASE if routed else Resolve.OFFER, got, base)
        return Resolution(Resolve.ADOPT if routed else Resolve.OFFER, got, base)

    # -- what the machine reports -----------------------------------------------------------

    def rebase_given_up(self, local: PublishedPlacement, base: PublishedPlacement) -> None:
        """The move from ``local``, a local survivor plan of ``base`` that a ``REBASE`` left
        routed, was given up (the version it moved to failed, and is refused, or a rank died):
        ``local`` is the local plan again, routed, as ``take_routed`` leaves it, but refusals
        stand. A version offered since that is not refused waits for ``resolving`` as before."""
        with self._lock:
            if self._local_plan is not None:  # a newer local plan came meanwhile: it stands
                return
            offered = self._offered
            self._from_service = offered if offered is not None and offered.version > self._refused else None
            self._offered = None
            self._local_plan, self._local_base = local, base

    def switched(self, published: PublishedPlacement) -> None:
        """The machine switched to ``published`` (its last chunk): unless it is the local plan,
        a service version replaced the local plan, which is forgotten."""
        if published is not self._local_plan:
            with self._lock:
                self._local_plan = self._local_base = self._from_service = None

    def refuse(self, version: int) -> None:
        """``version`` was aborted here: it is not prepared again; a newer one may be."""
        with self._lock:
            self._refused = max(self._refused, version)

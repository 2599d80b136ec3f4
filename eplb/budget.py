"""How long a search may go on: work units (deterministic) and an optional wall-clock cap.

A unit is one slot of one candidate placement looked at (a candidate row of ``B * S`` slots
costs ``B * S`` units), so the same input spends the same units and gives the same plan on
any machine. The wall clock only cuts a search short when a caller asks for it: every budget
of one plan then shares one ``Clock``, so a stop anywhere stops every later step of the plan.
"""

from __future__ import annotations

import time

__all__ = ["Budget", "Clock"]

# A step is predicted to take this many times the longest recent gap between two checks: steps
# of one kind vary (a repack step after count moves is several times longer), and a step that
# runs past the deadline is the whole overshoot, as nothing can stop it midway.
AHEAD = 2.0
# Each check weighs the gaps before it by this much less: a heavy step predicts the next few,
# not the rest of a long search.
FORGET = 0.5


class Clock:
    """A wall-clock ``deadline`` (a ``time.perf_counter()`` value, the same in every process
    of the machine) checked between steps. It is out once it has passed or the next step,
    predicted as ``AHEAD`` times the longest recent gap between checks, would pass it, and
    stays out: a later check right after a stop sees a short gap and would start a step.

    It also learns the seconds per work unit (the units charged between two checks against
    the gap), so that a step that sizes itself (a batch of candidates) takes no more than
    ``fit`` says the time left pays for: one step of a whole budget's units can take longer
    than the whole limit on a loaded machine."""

    def __init__(self, deadline: float) -> None:
        self.deadline = float(deadline)
        self.expired = False
        self.last = time.perf_counter()
        self.step = 0.0
        self.charged = 0.0  # units since the last check
        self.rate = 0.0  # seconds per unit, the largest recent
        self.busy, self.units = 0.0, 0.0  # all charged gaps and their units: the mean rate

    def left(self) -> float:
        """Seconds to the deadline (negative past it); expires the clock once it has passed."""
        left = self.deadline - time.perf_counter()
        if left <= 0:
            self.expired = True
        return left

    def out(self) -> bool:
        """Whether the next step should not start."""
        if self.expired:
            return True
        now = time.perf_counter()
        gap = now - self.last
        self.step = max(gap, self.step * FORGET)
        if self.charged > 0:
            self.busy, self.units = self.busy + gap, self.units + self.charged
            # Step kinds differ in seconds per unit (a pairing step more than a count move): the
            # mean keeps a cheap step from making the next, dearer kind look cheap.
            self.rate = max(gap / self.charged, self.rate * FORGET, self.busy / self.units)
        self.last, self.charged = now, 0.0
        if now + AHEAD * self.step > self.deadline:
            self.expired = True
        return self.expired

    def fit(self, count: int, cost: float) -> int:
        """``count`` items of ``cost`` units each, cut to what the time left pays for
        ``AHEAD`` times over (all of them until a rate is known: the first step is the one
        nothing predicts); when not one fits, the clock is out."""
        if self.rate <= 0:
            return count
        room = max(self.deadline - time.perf_counter(), 0.0) / (AHEAD * self.rate * cost)
        if room < 1:
            self.expired = True
        return int(min(room, count))


class Budget:
    """``units``: work a search may spend (``None``: no limit); ``clock``: the plan's deadline
    (``None``: none), shared with every budget ``share`` makes from this one."""

    def __init__(self, units: float | None = None, clock: Clock | None = None) -> None:
        self.units, self.clock = units, clock
        self.spent = 0.0

    @property
    def timed_out(self) -> bool:
        """Whether the deadline has stopped (or would stop) a step of this plan."""
        return self.clock is not None and self.clock.expired

    def spend(self, units: float) -> None:
        self.spent += float(units)
        if self.clock is not None:
            self.clock.charged += float(units)

    def fit(self, count: int, cost: float) -> int:
        """``count`` items of ``cost`` units each, cut to what the units left pay for and what
        the clock's time left does (``Clock.fit``); 0 when nothing fits. A batch that sizes
        itself by this stays one step within the deadline."""
        if self.units is not None:
            count = min(count, int(max(self.units - self.spent, 0.0) // cost))
        if self.clock is not None:
            count = self.clock.fit(count, cost)
        return max(count, 0)

    def out(self) -> bool:
        """Whether the next step should not start (checked between steps)."""
        if self.units is not None and self.spent >= self.units:
            return True
        return self.late()

    def late(self) -> bool:
        """Whether the deadline alone says stop: for checks the units never needed, so a
        plan without a deadline runs as it did."""
        return self.clock is not None and self.clock.out()

    def share(self, fraction: float) -> Budget:
        """A budget for a first stage: ``fraction`` of the units left, the same clock."""
        left = None if self.units is None else max(self.units - self.spent, 0.0) * fraction
        return Budget(left, self.clock)

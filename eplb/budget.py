"""How long a search may go on: work units (deterministic) and an optional wall-clock cap.

A unit is one slot of one candidate placement looked at (a candidate row of ``B * S`` slots
costs ``B * S`` units), so the same input spends the same units and gives the same plan on
any machine. The wall clock only cuts a search short when a caller asks for it.
"""

from __future__ import annotations

import time

__all__ = ["Budget"]


class Budget:
    """``units``: work a search may spend (``None``: no limit); ``deadline``: a
    ``time.perf_counter()`` value past which no new step starts (``None``: no limit). A step is
    assumed to take as long as the last one, so a search stops before it would overrun."""

    def __init__(self, units: float | None = None, deadline: float | None = None) -> None:
        self.units, self.deadline = units, deadline
        self.spent = 0.0
        self.timed_out = False
        self.last, self.step = time.perf_counter(), 0.0

    def spend(self, units: float) -> None:
        self.spent += float(units)

    def out(self) -> bool:
        """Whether the next step should not start (checked between steps)."""
        if self.units is not None and self.spent >= self.units:
            return True
        if self.deadline is None:
            return False
        now = time.perf_counter()
        self.step, self.last = now - self.last, now
        if now + self.step > self.deadline:
            self.timed_out = True
            return True
        return False

    def share(self, fraction: float) -> Budget:
        """A budget for a first stage: ``fraction`` of the units left, same deadline."""
        left = None if self.units is None else max(self.units - self.spent, 0.0) * fraction
        return Budget(left, self.deadline)

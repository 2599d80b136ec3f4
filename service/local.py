"""``LocalDeployment``: this replica's state for one deployment it follows (its window, its
follower, its planning and liveness state). :class:`.registry.Registry` owns them; the other
collaborators are handed one and change only the fields of their own room (named below)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .batcher import Batcher
from .hub import PlacementHub
from .trigger import TriggerSpec
from .windows import DecayWindow, SlidingWindow, WindowSpec

__all__ = ["LocalDeployment"]


@dataclass
class LocalDeployment:
    """This replica's state for one deployment: its window, follower (hub) and planning state."""

    deployment: pb.Deployment
    topology: eplb.Topology
    window_spec: WindowSpec
    trigger: TriggerSpec
    window: SlidingWindow | DecayWindow
    hub: PlacementHub
    ranks: frozenset[int]
    # Ingest's (service/ingest.py): the phy2log of recent versions (physical reports), the
    # window's flush state, the write-ahead entries and the report batcher; the planner's
    # (service/planner.py): ``lock`` (one plan of the deployment at a time here) and ``failing``.
    phy2log: dict[int, np.ndarray] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dirty: bool = False
    flushed_at: float = 0.0
    # Write-ahead entries of batches in ``window`` that no flush has folded in yet.
    unfolded: list[str] = field(default_factory=list)
    batcher: Batcher | None = None
    flushing: asyncio.Task | None = None
    # Flushes one at a time: an older blob landing last would drop entries a newer one folded.
    flush_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Why the last triggered re-plan failed, None while they succeed (logs once per change).
    failing: str | None = None
    # Liveness (service/liveness.py; 0: off): rank → the latest report or ack this replica
    # answered, those not written to the store yet, and the ranks last counted suspect.
    suspect_after_s: float = 0.0
    seen: dict[int, float] = field(default_factory=dict)
    seen_unwritten: dict[int, float] = field(default_factory=dict)
    suspect: frozenset[int] = frozenset()

    def saw(self, rank: int) -> None:
        """A report or ack of ``rank`` was answered: note the time (``Liveness.run`` writes it)."""
        if not self.suspect_after_s:
            return
        now = time.time()
        if now > self.seen.get(rank, 0.0):
            self.seen[rank] = now
            self.seen_unwritten[rank] = now

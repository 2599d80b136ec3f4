"""``LocalDeployment``: this instance's state for one deployment it follows (its window, its
follower, its planning and liveness state). :class:`.registry.Registry` owns them; the other
collaborators are handed one and change only the fields of their own room (named below)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .batcher import Batcher
from .codec import DEFAULT_TOP_K
from .hub import PlacementHub
from .trigger import TriggerSpec
from .windows import DecayWindow, SlidingWindow, WindowSpec

__all__ = ["LocalDeployment", "MAX_BATCH_REPORTS"]

# Reports an instance keeps the batch size of, per deployment planned for time.
MAX_BATCH_REPORTS = 4096


@dataclass
class LocalDeployment:
    """This instance's state for one deployment: its window, follower (hub) and planning state."""

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
    # The planner's: before this time the trigger cannot be due (trigger.next_check), so its
    # marks are not read.
    next_trigger_check: float = 0.0
    # Liveness (service/liveness.py; 0: off): rank → the latest report or ack this instance
    # answered, those not written to the store yet, and the ranks last counted suspect.
    suspect_after_s: float = 0.0
    seen: dict[int, float] = field(default_factory=dict)
    seen_unwritten: dict[int, float] = field(default_factory=dict)
    suspect: frozenset[int] = frozenset()
    # Reports' (time, tokens per gpu per step, steps), the last MAX_BATCH_REPORTS: what a plan for
    # time learns its batch sizes from (Planning.kernel_model without tokens_per_gpu). This
    # instance's reports only, in memory: after a restart, plans are for tokens until reports
    # with steps arrive again.
    batches: deque = field(default_factory=lambda: deque(maxlen=MAX_BATCH_REPORTS))

    def note_batch(self, counts: np.ndarray, steps: int, now: float) -> None:
        """A fresh report of ``steps`` steps: its tokens per step (counts summed per layer, over
        top_k, meaned over layers), kept for the plans for time that learn their batch sizes."""
        p = self.deployment.planning
        if not steps or not p.kernel_model or p.tokens_per_gpu:
            return
        top_k = p.top_k if p.HasField("top_k") else DEFAULT_TOP_K
        per_step = float(np.asarray(counts, dtype=np.float64).sum(axis=1).mean()) / top_k / steps
        self.batches.append((now, per_step, steps))

    def batch_sizes(self, now: float) -> list[tuple[int, float]]:
        """The tokens per gpu per step of the reports within the window (``note_batch``), as
        ``(size, weight)`` pairs: the steps-weighted quartile midpoints (1/8, 3/8, 5/8, 7/8), equal
        sizes merged; empty before any report with steps."""
        horizon = self.window_spec.stale_after_s
        kept = [(b, s) for t, b, s in self.batches if now - t <= horizon and b > 0]
        if not kept:
            return []
        b = np.array([x for x, _ in kept])
        w = np.array([s for _, s in kept], dtype=np.float64)
        order = np.argsort(b)
        cum = np.cumsum(w[order]) / w.sum()
        sizes: dict[int, float] = {}
        for q in (0.125, 0.375, 0.625, 0.875):
            size = max(1, round(float(b[order][min(np.searchsorted(cum, q), b.size - 1)])))
            sizes[size] = sizes.get(size, 0.0) + 0.25
        return sorted(sizes.items())

    def saw(self, rank: int) -> None:
        """A report or ack of ``rank`` was answered: note the time (``Liveness.run`` writes it)."""
        if not self.suspect_after_s:
            return
        now = time.time()
        if now > self.seen.get(rank, 0.0):
            self.seen[rank] = now
            self.seen_unwritten[rank] = now

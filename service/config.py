"""``BalancerConfig``: one instance's timings and pool sizes (``eplb serve`` flags set them)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from eplb import limits

__all__ = ["BalancerConfig"]


@dataclass(frozen=True)
class BalancerConfig:
    """Timings in seconds. ``lease_s`` bounds how long a crashed planner blocks the others."""

    # This instance's id (the name predates the glossary: it keys the instance's window blob in the
    # store and prefixes its planning lease owner, so it stays).
    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lease_s: float = 10.0
    flush_s: float = 1.0
    tick_s: float = 0.5
    refresh_s: float = 2.0
    # Worker processes for re-plans and for stateless ComputePlacement calls (service/solver.py);
    # 0 plans in a thread of the serving process (only to measure what the pools buy).
    plan_workers: int = limits.REPLAN_WORKERS
    compute_workers: int = limits.COMPUTE_WORKERS
    # Processes only re-plans below limits.SMALL_PLAN_CELLS take (service/solver.py); 0: none.
    small_plan_workers: int = limits.SMALL_PLAN_WORKERS
    # Processes one re-plan of a deployment (Rebalance, the trigger loop) plans its layers in
    # (the library's workers=; the plan is the same for any number). Stateless calls and dry
    # runs always plan in one, so a remote caller cannot take more than its worker's core.
    layer_workers: int = 1
    # Plugin modules whose policies deployments may name (service/plugins.py); installed
    # packages' eplb.policies entry points load as well.
    plugins: tuple[str, ...] = ()
    # The server's largest gRPC message (--max-message-bytes): a deployment whose placement
    # cannot be sent in one is refused on create (the server sets it from its own config).
    max_message_bytes: int = 16 << 20
    # How often this instance writes the times it saw ranks (reports, acks) to the store and
    # re-counts suspect ranks (service/liveness.py): another instance's view is this much old at
    # most, so it is the precision of Liveness.suspect_after (added to it as a margin).
    liveness_s: float = 1.0
    # Group commit of reports (service/batcher.py, service/ingest.py): the store calls of a
    # shard's deployments (one pipeline for the reports of all of them; a Redis Cluster master's
    # each; a deployment of more than SHARED_MAX_COUNTS counts a report, its own) start at least
    # this far apart while reports keep coming (one goes at once after a quiet spell), so that a
    # high report rate costs fewer round trips; each report's answer waits at most this much more.
    report_linger_s: float = 0.005
    # A reads-only instance (``eplb serve --reads-only``) refuses reports (UNAVAILABLE: the
    # client's next address takes them) and runs no trigger loop or window flushes: its one event
    # loop serves placements, watches and the rest from memory, never behind a queue of reports.
    # Engines send their reads to it (``ServiceClient(..., reads=...)``, ``EPLB_READ_ADDRESSES``).
    reads_only: bool = False

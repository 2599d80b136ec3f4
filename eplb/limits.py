"""The documented limits, shared by the service (docs/service.md, "Limits") and the tools,
and the estimate of the memory a plan needs, so that both refuse what cannot fit before they
allocate. Each is a module constant so operators and tests read the same figure the checks use.

The service's limits keep one tenant's input from making a deployment unreadable, the store or a
replica run out of memory, or a window sum overflow; they are checked before any state is written.
"""

from __future__ import annotations

__all__ = [
    "COMPUTE_QUEUE",
    "COMPUTE_WORKERS",
    "ILP_MAX_CELLS",
    "ILP_MAX_SECONDS",
    "MAX_DEPLOYMENTS",
    "MAX_EXPERTS",
    "MAX_GPUS",
    "MAX_LAYERS",
    "MAX_PLACEMENT_BYTES",
    "MAX_REPORT_COUNT",
    "MAX_SLOTS",
    "MAX_SUSPECT_AFTER_S",
    "MAX_WINDOW_BYTES",
    "MIN_SUSPECT_AFTER_S",
    "MIN_TRIGGER_INTERVAL_S",
    "PLAN_BYTES_PER_EXPERT",
    "PLAN_BYTES_PER_EXPERT_GPU",
    "PLAN_BYTES_PER_SLOT_PAIR",
    "REPLAN_WORKERS",
    "SMALL_PLAN_CELLS",
    "SMALL_PLAN_WORKERS",
    "plan_bytes",
]

# Largest count one report may carry in one [layer, expert] (or slot) entry. A window sums at
# most a few million reports, so its sums stay far below float64's range (and exact far beyond
# any realistic token count): no report can make a window infinite.
MAX_REPORT_COUNT = 1e12

# Planning capacity of the service (service/solver.py). Re-plans of deployments run in their own pool, which
# stateless ComputePlacement calls never use: those get COMPUTE_WORKERS processes and a queue of
# COMPUTE_QUEUE calls, and RESOURCE_EXHAUSTED beyond.
REPLAN_WORKERS = 2
COMPUTE_WORKERS = 2
COMPUTE_QUEUE = 4
# The small-plan lane (docs/service.md, "Fairness between tenants"): a re-plan of fewer than
# SMALL_PLAN_CELLS layers x slots may also run in SMALL_PLAN_WORKERS processes that larger ones
# never take, so two limit-size re-plans (128 x 8192 = 2^20 cells, ~10 s each) holding both
# REPLAN_WORKERS do not make a small deployment's re-plan wait for them. 2^18 cells (e.g. 256
# layers x 1024 slots, 58 x 4096) plan in about a second; a DeepSeek-V3-sized 58 x 288 has 16,704.
SMALL_PLAN_CELLS = 1 << 18
SMALL_PLAN_WORKERS = 1

# A trigger interval shorter than this (other than 0, off) is refused on create: each re-plan
# takes one of the REPLAN_WORKERS processes for up to half the interval (the Planning default),
# so a deployment re-planning every microsecond would keep one busy for good.
MIN_TRIGGER_INTERVAL_S = 1.0

# Liveness.suspect_after, other than 0 (off): replicas share the times they saw ranks once a
# second, so a shorter threshold would be below the precision of what it compares; beyond a week
# it is more likely a unit mistake than a wish.
MIN_SUSPECT_AFTER_S = 1.0
MAX_SUSPECT_AFTER_S = 7 * 24 * 3600.0

# policy "ilp" (CP-SAT per layer) costs far more than the others: a plan may take at most
# ILP_MAX_SECONDS in all (less when the call's deadline is nearer), on one solver thread, and
# only for layers of at most ILP_MAX_CELLS experts x gpus.
ILP_MAX_SECONDS = 30.0
ILP_MAX_CELLS = 8192

# Sizes, checked on create and on every stateless call before anything is stored or planned.
# A placement (int32 [L, P]) travels whole in every GetPlacement and WatchPlacements answer and
# is kept 16 times per deployment; the window (float64 [L, E]) once per replica.
MAX_LAYERS = 1024
MAX_EXPERTS = 8192
MAX_SLOTS = 16384
MAX_GPUS = 4096
MAX_PLACEMENT_BYTES = 4 << 20
MAX_WINDOW_BYTES = 16 << 20
# Deployments one service (all its replicas, one Redis key prefix) holds.
MAX_DEPLOYMENTS = 1000

# Peak memory of one plan (``plan_bytes``), fitted to the peak RSS of ``eplb place --synthetic
# zipf-1.0 --effort fast --layers L --experts E --slots P --gpus G`` (``/usr/bin/time -f %M``,
# less the interpreter's ~50 MB), in MB: L=1, E=P=2e5 / 4e5 / 1e6, G=1000: 238 / 485 / 1220;
# L=1, E=4e5, P=4e5, G=100: 228; L=1, E=P=4000 / 8000 / 12000, G=1: 60 / 252 / 570; L=2000,
# E=256, P=288, G=32: 74. Per layer: about 2 B per (expert, gpu), 4 B per pair of one gpu's slots
# and 128 B per expert; the estimate is within -15 % / +80 % of those runs.
PLAN_BYTES_PER_EXPERT = 128
PLAN_BYTES_PER_EXPERT_GPU = 2
PLAN_BYTES_PER_SLOT_PAIR = 4


def plan_bytes(topology: object) -> int:
    """An estimate of the peak memory, in bytes, of planning ``topology`` (an ``eplb.Topology``)
    with the default policy: ``L * (128 E + 2 E G + 4 S^2)`` for ``S`` slots per gpu (fitted
    above; tens of MB low for small instances, which fit anywhere)."""
    L, E, G, S = topology.num_layers, topology.num_experts, topology.num_gpus, topology.slots_per_gpu
    return L * (PLAN_BYTES_PER_EXPERT * E + PLAN_BYTES_PER_EXPERT_GPU * E * G + PLAN_BYTES_PER_SLOT_PAIR * S * S)

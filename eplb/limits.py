"""The documented limits, shared by the service (docs/service.md, "Limits") and the tools,
and the estimate of the memory a plan needs with the most it may need (``max_plan_bytes``,
raised with ``set_max_plan_bytes``), so that the library and the tools refuse what cannot fit
before they allocate. Each is a module constant so operators and tests read the same figure the checks use.

The service's limits keep one tenant's input from making a deployment unreadable, the store or a
replica run out of memory, or a window sum overflow; they are checked before any state is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import checks
from .planner.packing import swap_partners
from .planner.search import CHUNK

if TYPE_CHECKING:
    from .topology import Topology

__all__ = [
    "MAX_BATCH_SIZES",
    "MAX_REPORT_COVERS",
    "MAX_REPORT_STEPS",
    "MAX_TOKENS_PER_GPU",
    "MAX_TOP_K",
    "COMPUTE_QUEUE",
    "COMPUTE_WORKERS",
    "ILP_MAX_CELLS",
    "ILP_MAX_SECONDS",
    "MAX_DEPLOYMENTS",
    "MAX_EXPERTS",
    "MAX_GPUS",
    "MAX_LAYERS",
    "MAX_PLACEMENT_BYTES",
    "MAX_PLAN_BYTES",
    "MAX_REPORT_COUNT",
    "MAX_SLOTS",
    "MAX_SUSPECT_AFTER_S",
    "MAX_WINDOW_BYTES",
    "MIN_SUSPECT_AFTER_S",
    "MIN_TRIGGER_INTERVAL_S",
    "PLAN_BYTES_BASE",
    "PLAN_BYTES_PER_EXPERT",
    "PLAN_BYTES_PER_EXPERT_GPU",
    "PLAN_BYTES_PER_SLOT",
    "PLAN_BYTES_PER_SLOT_PAIR",
    "PLAN_BYTES_PER_SWAP_PAIR",
    "REPLAN_BYTES_PER_SLOT",
    "REPLAN_BYTES_PER_SWAP_PAIR",
    "REPLAN_WORKERS",
    "SEARCH_BYTES_PER_SLOT",
    "SMALL_PLAN_CELLS",
    "SMALL_PLAN_WORKERS",
    "check_plan_bytes",
    "max_plan_bytes",
    "plan_bytes",
    "set_max_plan_bytes",
    "size_text",
]

# Largest count one report may carry in one [layer, expert] (or slot) entry. A window sums at
# most a few million reports, so its sums stay far below float64's range (and exact far beyond
# any realistic token count): no report can make a window infinite.
MAX_REPORT_COUNT = 1e12
"""Largest count one report may carry in one ``[layer, expert]`` (or slot) entry: windows stay finite and exact."""
# ReportLoadRequest.steps: the most forward steps one report may say it covers.
MAX_REPORT_STEPS = 1 << 20
"""The most forward steps one report may say it covers (``ReportLoadRequest.steps``)."""
# ReportLoadRequest.covers: the most ranks' reports one node report may hold.
MAX_REPORT_COVERS = 4096
"""The most ranks' reports one node report may hold (``ReportLoadRequest.covers``)."""
# Planning for time (Planning.kernel_model): at most MAX_BATCH_SIZES tokens_per_gpu sizes, each 1 ..
# MAX_TOKENS_PER_GPU (a plan for time costs about one search per size); top_k 1 .. MAX_TOP_K.
MAX_BATCH_SIZES = 16
"""The most ``tokens_per_gpu`` sizes a plan for time takes (each costs about one search)."""
MAX_TOKENS_PER_GPU = 1 << 20
"""The largest ``tokens_per_gpu`` size a plan for time takes."""
MAX_TOP_K = 64
"""The largest ``top_k`` (experts each token picks) a plan for time takes."""

# Planning capacity of the service (service/solver.py). Re-plans of deployments run in their own pool, which
# stateless ComputePlacement calls never use: those get COMPUTE_WORKERS processes and a queue of
# COMPUTE_QUEUE calls, and RESOURCE_EXHAUSTED beyond.
REPLAN_WORKERS = 2
"""Processes the service re-plans deployments in (``--plan-workers``)."""
COMPUTE_WORKERS = 2
"""Processes for stateless ``ComputePlacement`` calls, apart from re-plans (``--compute-workers``)."""
COMPUTE_QUEUE = 4
"""``ComputePlacement`` calls that may wait for a worker; more get ``RESOURCE_EXHAUSTED`` with a retry hint."""
# The small-plan lane (docs/service.md, "Fairness between tenants"): a re-plan of fewer than
# SMALL_PLAN_CELLS layers x slots may also run in SMALL_PLAN_WORKERS processes that larger ones
# never take, so two limit-size re-plans (128 x 8192 = 2^20 cells, ~10 s each) holding both
# REPLAN_WORKERS do not make a small deployment's re-plan wait for them. 2^18 cells (e.g. 256
# layers x 1024 slots, 58 x 4096) plan in about a second; a DeepSeek-V3-sized 58 x 288 has 16,704.
SMALL_PLAN_CELLS = 1 << 18
"""A re-plan of fewer layers x slots than this may also run in the small-plan lane, so big tenants' re-plans do not hold it."""
SMALL_PLAN_WORKERS = 1
"""Processes of the small-plan lane, which larger re-plans never take."""

# A trigger interval shorter than this (other than 0, off) is refused on create: each re-plan
# takes one of the REPLAN_WORKERS processes for up to half the interval (the Planning default),
# so a deployment re-planning every microsecond would keep one busy for good.
MIN_TRIGGER_INTERVAL_S = 1.0
"""The shortest trigger interval (seconds, other than 0: off) a deployment may have."""

# Liveness.suspect_after, other than 0 (off): replicas share the times they saw ranks once a
# second, so a shorter threshold would be below the precision of what it compares; beyond a week
# it is more likely a unit mistake than a wish.
MIN_SUSPECT_AFTER_S = 1.0
"""The shortest ``Liveness.suspect_after`` (seconds, other than 0: off)."""
MAX_SUSPECT_AFTER_S = 7 * 24 * 3600.0
"""The longest ``Liveness.suspect_after`` (seconds): a week."""

# policy "ilp" (CP-SAT per layer) costs far more than the others: a plan may take at most
# ILP_MAX_SECONDS in all (less when the call's deadline is nearer), on one solver thread, and
# only for layers of at most ILP_MAX_CELLS experts x gpus.
ILP_MAX_SECONDS = 30.0
"""The most seconds an ``ilp`` plan may take in all (less when the call's deadline is nearer)."""
ILP_MAX_CELLS = 8192
"""The largest layer (experts x gpus) policy ``ilp`` plans."""

# Sizes, checked on create and on every stateless call before anything is stored or planned.
# A placement (int32 [L, P]) travels whole in every GetPlacement and WatchPlacements answer and
# is kept 16 times per deployment; the window (float64 [L, E]) once per replica.
MAX_LAYERS = 1024
"""The most layers a topology may have."""
MAX_EXPERTS = 8192
"""The most experts a layer may have."""
MAX_SLOTS = 16384
"""The most slots a topology may have."""
MAX_GPUS = 4096
"""The most gpus a topology may have."""
MAX_PLACEMENT_BYTES = 4 << 20
"""The largest placement (int32 ``[L, P]``, in bytes) a deployment may have: it travels whole to every watcher."""
MAX_WINDOW_BYTES = 16 << 20
"""The largest load window (float64 ``[L, E]``, in bytes) a deployment may have."""
# Deployments one service (all its replicas, one Redis key prefix) holds.
MAX_DEPLOYMENTS = 1000
"""Deployments one service (all its instances, one Redis key prefix) holds."""

# Peak memory of one plan (``plan_bytes``), fitted as an upper bound of the peak of numpy's
# allocations (tracemalloc) during ``eplb.rebalance`` at default effort, fresh plans, re-plans
# and plans with a gpu down at 13 shapes under zipf-1.0 and lognormal-1.0 loads (``python -m
# eplb_bench.plan_memory``; the table is in docs/algorithms.md, "Memory"), and small plans (a
# few layers) at 5 more. PLAN_BYTES_BASE for
# any plan (its result, its notes), then per layer of a plan, for S slots per gpu:
# - PLAN_BYTES_PER_EXPERT, PLAN_BYTES_PER_SLOT and PLAN_BYTES_PER_EXPERT_GPU: the rows, counts
#   and, in the count moves, which gpu holds which expert (a bool per (expert, gpu));
# - PLAN_BYTES_PER_SLOT_PAIR per pair of one gpu's slots for each node (the deal of a row's
#   replicas holds each of its S merge steps' sort of the partials), and PLAN_BYTES_PER_SWAP_PAIR
#   for each gpu (the swaps' item grids);
# - the search after the first plan, where there are redundant slots and gpus to move them
#   between: SEARCH_BYTES_PER_SLOT per slot of each layer searched together (a chunk of
#   eplb.planner.search.CHUNK, whatever the layers), twice that at two slots per gpu (its
#   count moves weigh twice the donors there);
# - a re-plan (``previous=``) also REPLAN_BYTES_PER_SLOT (its candidates and their alignment to
#   the previous placement) and REPLAN_BYTES_PER_SWAP_PAIR per item pair of its
#   repairs' swap grids, ``swap_partners(G) * S * S`` (eplb.planner.packing): with many slots
#   per gpu, most of it (8 layers x 256 experts on 512 slots of 4 gpus: 79 MB, 1 MB fresh).
PLAN_BYTES_PER_EXPERT = 384
"""``plan_bytes``: bytes per expert of a layer (rows, counts)."""
PLAN_BYTES_PER_SLOT = 72
"""``plan_bytes``: bytes per slot of a layer."""
PLAN_BYTES_PER_EXPERT_GPU = 1
"""``plan_bytes``: bytes per (expert, gpu) of a layer (which gpu holds which expert)."""
PLAN_BYTES_PER_SLOT_PAIR = 4
"""``plan_bytes``: bytes per pair of one gpu's slots, per node (the deal's merge steps)."""
PLAN_BYTES_PER_SWAP_PAIR = 1
"""``plan_bytes``: bytes per pair of one gpu's slots, per gpu (the swaps' item grids)."""
SEARCH_BYTES_PER_SLOT = 2800
"""``plan_bytes``: bytes per slot of each layer the search after the first plan holds together."""
REPLAN_BYTES_PER_SLOT = 1200
"""``plan_bytes``: a re-plan's bytes per slot (its candidates and their alignment)."""
REPLAN_BYTES_PER_SWAP_PAIR = 200
"""``plan_bytes``: a re-plan's bytes per item pair of its repairs' swap grids."""
PLAN_BYTES_BASE = 1 << 20
"""``plan_bytes``: bytes of any plan (its result, its notes)."""

# The most ``plan_bytes`` a plan may need before the library refuses it (``ValueError``), unless
# raised with ``set_max_plan_bytes``: a plan that needs more than the machine has grows until
# the kernel kills the process, without a word (rebalance of 1 layer x 10**8 experts on 10**8
# slots grew to 23 GB in two minutes). 8 GiB covers every standard scale many times over, and
# the service's limit-size re-plan (replan_limits: 128 x 8192 x 8192 on 4096 gpus, 6.0 GB); a
# topology within the service's limits with few gpus of many slots can need far more (its swap
# grids), and is refused when planned. The tools set it to the memory available (``eplb
# place``: MemAvailable).
MAX_PLAN_BYTES = 8 << 30
"""The most ``plan_bytes`` a plan may need before the library refuses it (``ValueError``), unless raised with ``set_max_plan_bytes``: 8 GiB."""

_max_plan_bytes = MAX_PLAN_BYTES


def plan_bytes(topology: Topology, *, replan: bool = False) -> int:
    """An estimate of the peak memory, in bytes, of planning ``topology`` with the default
    policy at default effort (``replan``: from a previous placement, ``previous=``), fitted to
    be above the peaks measured (the constants above):
    ``1 MiB + L * (384 E + 72 P + E G + (4 N + G) S^2)``, plus ``min(L, 16) * 2800 P`` (5600 P
    at two slots per gpu) where there are redundant slots and two gpus or more, plus
    ``L * (1200 P + 200 swap_partners(G) S^2)`` for a re-plan; a plan with gpus down is its
    live gpus' plan."""
    L, E, P, G = topology.num_layers, topology.num_experts, topology.num_slots, topology.num_gpus
    N, S = topology.num_nodes, topology.slots_per_gpu
    need = PLAN_BYTES_BASE + L * (
        PLAN_BYTES_PER_EXPERT * E
        + PLAN_BYTES_PER_SLOT * P
        + PLAN_BYTES_PER_EXPERT_GPU * E * G
        + (PLAN_BYTES_PER_SLOT_PAIR * N + PLAN_BYTES_PER_SWAP_PAIR * G) * S * S
    )
    if G > 1 and P > E:
        need += min(L, CHUNK) * SEARCH_BYTES_PER_SLOT * (2 if S == 2 else 1) * P
    if replan:
        need += L * (REPLAN_BYTES_PER_SLOT * P + REPLAN_BYTES_PER_SWAP_PAIR * swap_partners(G) * S * S)
    return need


def max_plan_bytes() -> int:
    """The most ``plan_bytes`` a plan may need now: ``MAX_PLAN_BYTES`` unless set otherwise."""
    return _max_plan_bytes


def set_max_plan_bytes(limit: int | None) -> int:
    """Sets the most ``plan_bytes`` a plan may need, in bytes, for this process (``None``:
    ``MAX_PLAN_BYTES`` again), on a machine with the memory for larger plans; returns the limit
    it replaces. Planning calls check it before they allocate anything that grows with the
    topology, and raise ``ValueError`` above it."""
    global _max_plan_bytes
    if limit is not None:
        checks.positive_int("the plan memory limit", limit, allowed="a positive integer number of bytes or None")
    old, _max_plan_bytes = _max_plan_bytes, MAX_PLAN_BYTES if limit is None else int(limit)
    return old


def size_text(n: float) -> str:
    """``n`` bytes in decimal units, three significant digits: ``"40 PB"``, ``"8.59 GB"``."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return ""  # unreachable


def check_plan_bytes(topology: Topology, *, replan: bool = False) -> None:
    """Raises ``ValueError`` when planning ``topology`` (``replan``: see ``plan_bytes``) needs
    more than ``max_plan_bytes()``, naming both and how to raise the limit: called before
    anything that grows with the topology is allocated."""
    need, limit = plan_bytes(topology, replan=replan), _max_plan_bytes
    if need > limit:
        t = topology
        raise ValueError(
            f"{'a re-plan' if replan else 'a plan'} of {t.num_layers} layer{'s' if t.num_layers > 1 else ''} x "
            f"{t.num_experts} experts on {t.num_slots} slots ({t.slots_per_gpu} per gpu) needs about "
            f"{size_text(need)} of memory (eplb.limits.plan_bytes), more than the limit of {size_text(limit)} "
            f"(eplb.limits.max_plan_bytes()); on a machine with the memory, raise it with "
            f"eplb.set_max_plan_bytes(n); or plan fewer layers, experts or slots per gpu"
        )

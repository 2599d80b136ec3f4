"""The replicate-and-pack planner behind ``global``, ``hierarchical`` and ``auto``: a first
plan, then an anytime search.

``global`` is ``hierarchical`` with one node and one group: one code path, as in DeepSeek's
eplb.py, but with replica counts capped so no gpu needs two copies of an expert, a balanced
deal instead of a per-item greedy, and a swap step that lowers the busiest gpu. The steps it
runs live beside it in ``eplb.planner``: ``replicate`` (counts), ``packing`` (replicas onto
gpus), ``counts`` (count moves), ``hot`` (hot experts kept apart), ``pairing`` and ``search``
(the search after the first plan).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import checks
from ..bounds import row_bound
from ..budget import Budget, Clock
from ..layout import GOOD_ENOUGH, busiest, take_rows
from ..limits import check_plan_bytes
from ..progress import report
from ..result import SearchStats
from ..topology import Topology
from ..workers import worker_pool
from .borrow import borrow_counts, same_profile
from .counts import refine_counts
from .hot import separate_hot
from .packing import WIDE_SPREAD, pack, packed_loads
from .replicate import replica_cap, waterfill
from .search import CHUNK, refine_thorough

__all__ = ["PlanOptions", "EFFORTS", "plan_placement", "place_global", "flat_topology"]

EFFORTS = ("fast", "default", "high")
# Work units per layer of the search after the first plan: one unit is one slot of one candidate
# looked at (eplb.budget). Chosen so a full-model default plan stays under a second on one core
# at the standard scales (bench/default_bench.py); "high" searches wider and four times longer.
DEFAULT_WORK = 100_000
HIGH_WORK = 400_000
# Layers whose first plan is made together: each (layer, node) row's first plan is its own, so
# blocks make the same plan as one pass, and a long plan (20000 layers) reports progress and
# holds its temporaries per block rather than once for every layer.
FIRST_BLOCK = 64 * CHUNK
# Share of a chunk's search budget that rows of a shared profile spend before they borrow
# counts from each other, by slots per gpu. Three or more: half (qwen3-64 zipf 1.5: 1.0161 ->
# 1.0084 with 18 % less work). Two: all of it, since the pairing search's last lines (sweep,
# descent) run only on what the count moves leave, and cut short they lose more than the
# borrowed counts win (256e/256gpu zipf 0.8: 1.0119 -> 1.0124 with half).
_FIRST_SHARE = {2: 1.0}
_FIRST_SHARE_MANY = 0.5
# The second search of shared-profile rows starts only with this share of the chunk's budget
# left: its first steps spend their units whatever is left.
_AGAIN_LEFT = 0.1


@dataclass(frozen=True)
class PlanOptions:
    """Options of the replicate-and-pack policies, checked when made (``ValueError`` names the
    option and what it allows).

    - ``effort``: ``"fast"`` the first plan only; ``"default"`` then the anytime search;
      ``"high"`` a wider search with four times the work;
    - ``work_budget``: work units per layer after the first plan (``None``: the effort's);
    - ``gap``: a layer's search stops within this fraction of its lower bound;
    - ``time_limit``: wall-clock seconds for the whole plan (``None``: none; not deterministic);
    - ``workers``: processes planning layer chunks (and a re-plan's candidates) in parallel;
      the plan is the same for any number;
    - ``max_rounds``: swap rounds after the deal; ``refine``: count moves per layer in the first
      plan (0: keep water-filling counts); ``donors``: donor experts a count move considers
      (``None``: 8, or 4 with <= 2 slots per gpu).
    """

    effort: str = "default"
    work_budget: float | None = None
    gap: float = 0.001
    time_limit: float | None = None
    workers: int = 1
    max_rounds: int = 16
    refine: int = 8
    donors: int | None = None

    def __post_init__(self) -> None:
        checks.nonneg_int("option max_rounds", self.max_rounds)
        checks.nonneg_int("option refine", self.refine)
        if self.donors is not None:
            checks.positive_int("option donors", self.donors, none="")
        if self.time_limit is not None:
            checks.positive_number("option time_limit", self.time_limit, allowed="a positive number of seconds or None")
        checks.one_of("option effort", self.effort, EFFORTS)
        if self.work_budget is not None:
            checks.nonneg_number(
                "option work_budget",
                self.work_budget,
                finite=True,
                allowed="a finite number of work units >= 0 per layer or None",
            )
        checks.nonneg_number("option gap", self.gap, "a fraction, 0.001 = 0.1 %")
        checks.positive_int("option workers", self.workers, "processes")

    @property
    def replan_workers(self) -> int:
        """Processes a re-plan's candidates use (``rebalance`` reads it): ``workers``."""
        return int(self.workers)

    @property
    def work_per_layer(self) -> float:
        """The search's work units per layer: ``work_budget``, or the effort's default."""
        if self.work_budget is not None:
            return float(self.work_budget)
        return float(HIGH_WORK if self.effort == "high" else DEFAULT_WORK)


def _donors(donors: int | None, slots_per_gpu: int) -> int:
    # Under strong skew a wider donor search is what lowers the busiest gpu (v3-64 zipf 1.5:
    # 1.188 with 4 donors, 1.053 with 8). With two slots per gpu the pairing already decides
    # most of the balance and 8 donors cost a third more time for 0.05 %.
    if donors is not None:
        return int(donors)
    return 4 if slots_per_gpu <= 2 else 8


def plan_placement(
    loads: np.ndarray,
    topology: Topology,
    options: PlanOptions,
    deadline: float | None = None,
    phase: str = "first plan",
) -> tuple[np.ndarray, SearchStats]:
    """``loads``: float64 ``[L, E]`` → ``phy2log`` int32 ``[L, P]`` and what the search did.

    Hierarchical (groups → nodes → gpus) when the topology has nodes and groups, else global.
    1. pack expert groups onto nodes (equal group count per node);
    2. give each node's experts that node's slots by water-filling, at most one replica per gpu
       of the node;
    3. pack each node's replicas onto its gpus, then count moves: the first plan
       (``effort="fast"`` stops here);
    4. anytime search (``refine_thorough``) on the (layer, node) rows whose busiest gpu is
       more than ``gap`` above what they can reach (their lower bound, or the layer's busiest
       node), until ``work_budget`` units per layer are spent or ``time_limit`` is up; rows of
       one chunk borrow each other's replica counts by load rank (``borrow``).
    Requires ``num_groups % num_nodes == 0``. ``deadline``: a ``time.perf_counter()`` value
    the search stops before (default: now plus ``time_limit``), for a caller whose limit
    started earlier. The first plan (1-3) runs whole whatever the time: it is what the limit
    can never cut, and ``SearchStats.first_plan_over`` says when it alone ran past it.
    ``phase``: what ``eplb.progress`` calls the first plan (then ``"search"``; ``"plan"`` per
    job with ``workers`` > 1). Raises ``ValueError`` when ``eplb.limits.plan_bytes`` of
    ``topology`` is above ``eplb.limits.max_plan_bytes()``.
    """
    topo = topology
    check_plan_bytes(topo)
    if topo.num_groups % topo.num_nodes:
        raise ValueError(
            f"hierarchical needs num_groups ({topo.num_groups}) to be a multiple of num_nodes "
            f"({topo.num_nodes}); use policy 'global'"
        )
    opts = options
    if deadline is None and opts.time_limit is not None:
        deadline = time.perf_counter() + float(opts.time_limit)
    workers = int(opts.workers)
    L = topo.num_layers
    if workers == 1 or L <= CHUNK:
        return _plan_chunks(loads, topo, opts, deadline, phase)
    chunks = -(-L // CHUNK)
    # With a deadline, one job per process, each a run of whole chunks: a job plans all its
    # first plans before it searches, where a chunk queued behind another's search would start
    # its first plan only at the deadline. Chunks stay chunks, so the plan is the same.
    size = CHUNK if deadline is None else CHUNK * -(-chunks // min(workers, chunks))
    jobs = [(loads[a : a + size], topo.with_layers(min(size, L - a)), opts, deadline) for a in range(0, L, size)]
    parts, done = [], 0
    # Reported here as each job comes back (in order): the workers cannot reach the callback.
    report("plan", 0, L)
    for part in worker_pool(workers).map(_plan_job, jobs):
        parts.append(part)
        done += part[0].shape[0]
        report("plan", done, L)
    stats = SearchStats()
    for _, st in parts:
        stats += st
    return np.concatenate([p for p, _ in parts]), stats


def _plan_job(job: tuple[Any, ...]) -> tuple[np.ndarray, SearchStats]:
    return _plan_chunks(*job)


def _plan_chunks(
    loads: np.ndarray, topo: Topology, opts: PlanOptions, deadline: float | None, phase: str = "first plan"
) -> tuple[np.ndarray, SearchStats]:
    # The first plan runs whole, whatever the time: it is what any plan returns at least. The
    # clock starts after it, as it is no step of the search.
    L = topo.num_layers
    if L <= FIRST_BLOCK:
        rows = _first_plan(loads, topo, opts)
        report(phase, L, L)
    else:
        blocks = []
        for a in range(0, L, FIRST_BLOCK):
            b = min(a + FIRST_BLOCK, L)
            blocks.append(_first_plan(loads[a:b], topo.with_layers(b - a), opts))
            report(phase, b, L)
        rows = _Rows.concat(blocks)
    clock = None if deadline is None else Clock(deadline)
    over = clock is not None and clock.left() <= 0
    stats = SearchStats()
    if opts.effort != "fast" and not over:
        for a in range(0, L, CHUNK):
            stats += _search(rows, slice(a, min(a + CHUNK, L)), topo, opts, clock)
            report("search", min(a + CHUNK, L), L)
    late = clock is not None and clock.expired
    return rows.finish(), stats + SearchStats(timed_out=late, first_plan_over=over)


@dataclass
class _Rows:
    """The per-node packing problem: ``loads`` ``[L*N, E/N]``, ``phy`` ``[L*N, gpn, S]`` local
    expert ids, ``node_experts`` ``[L, N, E/N]``, ``floor`` ``[L*N]`` (the busiest node's mean
    gpu load, below which no gpu of the layer needs to go) and the replica ``cap``."""

    loads: np.ndarray
    phy: np.ndarray
    node_experts: np.ndarray
    floor: np.ndarray
    cap: int | None

    @staticmethod
    def concat(parts: list[_Rows]) -> _Rows:
        """The rows of consecutive blocks of layers as one (their ``cap`` is the same)."""
        return _Rows(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("loads", "phy", "node_experts", "floor")),
            parts[0].cap,
        )

    def finish(self) -> np.ndarray:
        L, N, _ = self.node_experts.shape
        local = np.sort(self.phy, axis=2).reshape(L, N, -1)
        return np.take_along_axis(self.node_experts, local, axis=2).reshape(L, -1).astype(np.int32)


def _first_plan(loads: np.ndarray, topo: Topology, opts: PlanOptions) -> _Rows:
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    N, G, groups = topo.num_nodes, topo.num_gpus, topo.num_groups
    max_rounds = int(opts.max_rounds)
    group_size = E // groups
    # Step 1: groups → nodes. node_groups[l, n, :] lists the groups of node n.
    group_load = loads.reshape(L, groups, group_size).sum(axis=2)
    node_groups = (
        pack(group_load, N, max_rounds=max_rounds) if N > 1 else np.broadcast_to(np.arange(groups), (L, 1, groups))
    )
    node_groups = np.sort(node_groups, axis=2)
    # node_experts[l, n, :]: the experts of node n's groups, ascending.
    node_experts = (node_groups[..., None] * group_size + np.arange(group_size)).reshape(L, N, E // N)
    # Step 2: replicate within each node, rows are (layer, node).
    local_loads = take_rows(loads, node_experts.reshape(L, E)).reshape(L * N, E // N)
    gpn = G // N
    cap = replica_cap(E // N, P // N, gpn)
    counts = waterfill(local_loads, P // N, cap)
    # Replicas as items: local expert id repeated count times, each carrying load / count.
    local_ids = np.repeat(np.tile(np.arange(E // N), L * N), counts.ravel()).reshape(L * N, P // N)
    item_w = take_rows(local_loads / counts, local_ids)
    # Step 3: replicas → gpus of the node.
    # A gpu of the busiest node carries at least that node's mean, so no node needs its
    # gpus balanced below it.
    node_mean = local_loads.sum(axis=1).reshape(L, N) / gpn
    floor = np.repeat(node_mean.max(axis=1), N)
    # Wider paired rounds than the search's re-packs: fewer rounds, and a better start.
    assign = pack(item_w, gpn, local_ids, max_rounds=max_rounds, floor=floor, spread=WIDE_SPREAD)  # [L*N, gpn, S]
    slot_local = take_rows(local_ids, assign)
    # Count moves and hot-expert separation change only rows whose busiest gpu is above their
    # target, and each row on its own: hand them those rows alone (at v3-prefill lognormal
    # 1.0 none of global's 58, 3 of hierarchical's 232).
    busy = packed_loads(item_w, assign).max(axis=1)
    # Count moves need gpus free of duplicate replicas, which the cap guarantees.
    if cap is not None and gpn > 1 and opts.refine:
        target = np.maximum(floor, local_loads.sum(axis=1) / gpn * (1 + GOOD_ENOUGH))
        rows = np.flatnonzero(busy > target)
        if rows.size:
            slot_local[rows] = refine_counts(
                local_loads[rows],
                slot_local[rows],
                cap,
                iterations=int(opts.refine),
                donors=_donors(opts.donors, P // G),
                target=target[rows],
            )
            busy[rows] = busiest(local_loads[rows], slot_local[rows])
    # With few gpus per node, water-filling can make two hot experts share gpus; only nodes
    # whose busiest gpu is above the floor matter. The global policy's cap is the whole gpu
    # count, where this does not arise at the standard scales (the search after the first
    # plan tries anyway).
    if cap is not None and gpn > 1 and N > 1:
        rows = np.flatnonzero(busy > floor)
        if rows.size:
            slot_local[rows] = separate_hot(local_loads[rows], slot_local[rows], cap, target=floor[rows])
    return _Rows(local_loads, slot_local, node_experts, floor, cap)


def _search(rows: _Rows, layers: slice, topo: Topology, opts: PlanOptions, clock: Clock | None) -> SearchStats:
    """The anytime search on the rows of ``layers``, in place on ``rows.phy``."""
    N = topo.num_nodes
    n_layers = layers.stop - layers.start
    sel = slice(layers.start * N, layers.stop * N)
    loads, phy, cap = rows.loads[sel], rows.phy[sel], rows.cap
    X, B, S = phy.shape
    if cap is None or B < 2:
        return SearchStats()
    if clock is not None and clock.expired:
        # Past the deadline even the bound (a bisection per row at two slots per gpu, 60 ms per
        # chunk at v3-512 on a loaded core) is time over the limit: these layers go unsearched.
        return SearchStats(timed_out=True)
    per_layer = opts.work_per_layer
    now = busiest(loads, phy)
    reach = np.maximum(row_bound(loads, B, S, cap, now), rows.floor[sel])
    target = reach * (1 + float(opts.gap))
    todo = np.flatnonzero(now > target)
    budget = Budget(float(per_layer) * n_layers, clock)
    if todo.size == 0 or per_layer == 0:
        at_bound = (now <= target).reshape(n_layers, N).all(axis=1)
        return SearchStats(0.0, 0, int(at_bound.sum()), False)
    wide = opts.effort == "high"
    ld, tg = loads[todo], target[todo]
    best = phy[todo].copy()
    # Rows of a profile another row of the chunk shares (every layer under a zipf law) search
    # apart from the others: a share of their budget, then they borrow each other's counts
    # (eplb.planner.borrow), then the rest on those whose search would not repeat a donor's.
    # The searches of lone rows are left whole: split in two they lose more than they gain.
    twins = same_profile(ld)
    lone = np.flatnonzero(~twins)
    if lone.size:
        stage = budget.share(lone.size / todo.size)
        best[lone] = refine_thorough(ld[lone], best[lone], cap, stage, tg[lone], wide=wide, excess=True)
        _spent(budget, stage)
    twin = np.flatnonzero(twins)
    if twin.size and not budget.out():
        share = _FIRST_SHARE.get(S, _FIRST_SHARE_MANY)
        stage = budget.share(share)
        best[twin] = refine_thorough(ld[twin], best[twin], cap, stage, tg[twin], wide=wide)
        _spent(budget, stage)
        best[twin], settled = borrow_counts(ld[twin], best[twin], budget, target=tg[twin])
        again = twin[~settled & (busiest(ld[twin], best[twin]) > tg[twin])]
        # After a whole search, a second from where it stopped mostly retraces it.
        if share < 1 and again.size and budget.spent < budget.units * (1 - _AGAIN_LEFT):
            best[again] = refine_thorough(ld[again], best[again], cap, budget, tg[again], wide=wide)
    best, _ = borrow_counts(ld, best, budget, target=tg)
    if not budget.out():
        best = separate_hot(loads[todo], best, cap, target=target[todo], budget=budget)
    rows.phy[sel.start + todo] = best
    after = busiest(loads, rows.phy[sel])
    layer_ok = (after <= target).reshape(n_layers, N).all(axis=1)
    # Not np.unique: numpy 2 imports numpy.ma on its first call (40-100 ms), here often past
    # the deadline.
    searched = int(np.count_nonzero(np.bincount(todo // N, minlength=n_layers)))
    return SearchStats(budget.spent, searched, int(layer_ok.sum()), budget.timed_out)


def _spent(budget: Budget, stage: Budget) -> None:
    """Charge what a stage's budget (``Budget.share``) spent to the budget it came from."""
    budget.spend(stage.spent)


def place_global(loads: np.ndarray, topology: Topology, options: PlanOptions | None = None) -> np.ndarray:
    """``loads``: float64 ``[L, E]`` → ``phy2log`` int32 ``[L, P]``, ignoring nodes and groups."""
    return plan_placement(loads, flat_topology(topology), options or PlanOptions())[0]


def flat_topology(topology: Topology) -> Topology:
    """The same gpus and slots as one node and one group: what ``global`` plans for."""
    return Topology(topology.num_layers, topology.num_experts, topology.num_slots, topology.num_gpus)

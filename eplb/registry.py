"""Policies by name, and the one entry point ``rebalance``.

A policy is registered with its options (a frozen dataclass whose ``__post_init__`` checks
them, so a bad value fails once, with a message that names the option) and whether
``rebalance`` makes its plans migration-aware when given ``previous=`` (``replans``). The
re-plan itself (``eplb.replan``) is applied here, once, for every such policy; its options
(``eplb.replan.migration.Migration``: tolerances and move budgets) are accepted by every one.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from . import checks, metrics
from .limits import check_plan_bytes
from .loads import check_loads
from .placement import Placement
from .planner.anytime import PlanOptions
from .planner.settle import DEAL_SLACK, prefer_deal, settle
from .planner.spread import spread_nodes as spread_over_nodes
from .policies.deepseek import deepseek_rebalance
from .progress import Progress, check_callback, report, reporting
from .replan.choose import choose
from .replan.fresh import near_bound
from .replan.migration import Migration
from .result import Plan, SearchStats, SolverStats
from .survivors import Survivors, live_topology, restore, survivors
from .topology import Topology

if TYPE_CHECKING:
    from .kernel import CostModel
    from .timing import Batches

__all__ = [
    "PolicyError",
    "PolicyResult",
    "Policy",
    "PolicySpec",
    "register_policy",
    "unregister_policy",
    "policies",
    "get_policy",
    "rebalance",
]


class PolicyError(ValueError):
    """A policy handed back something that is not a valid plan: the policy's fault, not the
    caller's (the service answers ``INTERNAL``, not ``INVALID_ARGUMENT``). A ``ValueError``, so
    code that catches those still does."""


@dataclass(frozen=True)
class PolicyResult:
    """What a policy hands back: ``phy2log`` ``[L, P]``, the policy that ran (``auto`` names
    the one it chose), notes, whether a re-plan must keep expert groups whole on nodes
    (``groups_on_nodes``: hierarchical plans), and typed facts for ``Plan``."""

    phy2log: np.ndarray
    policy_used: str
    notes: tuple[str, ...] = ()
    groups_on_nodes: bool = False
    search: SearchStats | None = None
    solver: SolverStats | None = None


class Policy(Protocol):
    def __call__(self, loads: np.ndarray, topology: Topology, options: Any) -> PolicyResult: ...


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: ``fn(loads [L, E] float64, topology, options) -> PolicyResult``,
    its ``options`` dataclass (``None``: it takes none) and whether ``rebalance`` re-plans
    its plans migration-aware from ``previous=`` (``replans``)."""

    name: str
    fn: Policy
    options: type | None
    replans: bool

    def option_names(self) -> tuple[str, ...]:
        """Every option ``rebalance`` accepts for this policy: its own, then the re-plan's."""
        own = tuple(f.name for f in dataclasses.fields(self.options)) if self.options else ()
        return own + (tuple(f.name for f in dataclasses.fields(Migration)) if self.replans else ())

    def defaults(self) -> Any:
        """The policy's options with every default (``None`` when it takes none)."""
        return self.options() if self.options else None

    def parse(self, options: dict[str, Any]) -> tuple[Any, Migration | None]:
        """``rebalance``'s keyword options → (the policy's options, the re-plan's), both checked."""
        allowed = self.option_names()
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            if not allowed:
                raise ValueError(f"policy {self.name!r} takes no options, got {unknown}")
            raise ValueError(f"policy {self.name!r} got unknown option(s) {unknown}; allowed: {', '.join(allowed)}")
        migration_fields = {f.name for f in dataclasses.fields(Migration)} if self.replans else set()
        own = {k: v for k, v in options.items() if k not in migration_fields}
        mig = {k: v for k, v in options.items() if k in migration_fields}
        try:
            opts = self.options(**own) if self.options else None
        except TypeError as exc:  # a plugin's options class that rejects its own fields
            raise ValueError(f"policy {self.name!r}: bad options {sorted(own)}: {exc}") from None
        return opts, (Migration(**mig) if self.replans else None)


_REGISTRY: dict[str, PolicySpec] = {}
# rebalance's own arguments, which no policy option may be called.
_REBALANCE_ARGS = ("loads", "topology", "policy", "previous", "down_gpus", "spread_nodes", "progress")
# Policy names: what a deployment, the CLI and the wire can carry.
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def register_policy(name: str, *, options: type | None = None, replans: bool = False) -> Callable[[Policy], Policy]:
    """Decorator: make ``fn(loads [L, E] float64, topology, options) -> PolicyResult`` the policy
    ``name``. ``options``: a frozen dataclass of its options (checked in ``__post_init__``),
    ``None`` for none; ``replans``: ``rebalance`` makes its plans migration-aware from
    ``previous=`` (``eplb.replan``) and accepts the re-plan options for it."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"policy name must match {_NAME.pattern} (it goes on the wire and the command line), got {name!r}"
        )
    if options is not None:
        if not (dataclasses.is_dataclass(options) and isinstance(options, type)):
            raise ValueError(f"options must be a frozen dataclass type or None, got {options!r}")
        if not options.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise ValueError(f"options {options.__name__} must be a frozen dataclass (@dataclass(frozen=True))")
        fields = dataclasses.fields(options)
        bare = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if bare:
            raise ValueError(f"options {options.__name__}: every field needs a default, these have none: {bare}")
        own = sorted({f.name for f in fields} & set(_REBALANCE_ARGS))
        if own:
            # rebalance takes these itself: the policy's option would never be given.
            raise ValueError(f"options {options.__name__} may not reuse rebalance's own argument names {own}")
        clash = sorted({f.name for f in fields} & {f.name for f in dataclasses.fields(Migration)}) if replans else []
        if clash:
            raise ValueError(
                f"options {options.__name__} of a policy with replans=True may not reuse the re-plan's option names {clash}"
            )

    def deco(fn: Policy) -> Policy:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        _REGISTRY[name] = PolicySpec(name, fn, options, replans)
        return fn

    return deco


def unregister_policy(name: str) -> None:
    """Remove the policy ``name`` (a plugin's or a test's; ``ValueError`` if none)."""
    get_policy(name)
    del _REGISTRY[name]


def policies() -> tuple[str, ...]:
    """Names of the registered policies."""
    return tuple(sorted(_REGISTRY))


def get_policy(name: str) -> PolicySpec:
    """The registered policy ``name`` (``ValueError`` listing the registered ones if none)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; registered policies: {', '.join(policies())}") from None


# Under a time limit, the share of what is left after a re-plan's first plan that its fresh
# plan's search may take: the repairs of the previous placement after it need the rest, and
# they are what keeps moves low (at v3-prefill they take most of an unlimited re-plan's time).
FRESH_SHARE = 0.5


def _fresh_for_replan(
    spec: PolicySpec,
    loads: np.ndarray,
    topology: Topology,
    opts: PlanOptions,
    migration: Migration,
    bound: np.ndarray,
    deadline: float | None = None,
) -> tuple[PolicyResult, np.ndarray | None]:
    """A re-plan's fresh plan ``[L, P]`` and yardstick ``[L]`` (imbalance; ``None``: the fresh
    plan's own): the first plan everywhere, then the policy's full plan on the layers whose
    first plan is not near their bound (``eplb.replan.fresh``); the others measure against the
    bound plus the search's gap. ``deadline`` (a ``time.perf_counter()`` value): the full plan
    searches for ``FRESH_SHARE`` of the time left after the first plan, and not at all when
    none is left (those layers then measure against their first plan)."""
    # The first plan runs whole, as first plans do; the deadline is checked after it.
    first_opts = dataclasses.replace(opts, effort="fast", time_limit=None)
    begun = time.perf_counter()
    result = spec.fn(loads, topology, first_opts)
    took = time.perf_counter() - begun
    if not isinstance(result, PolicyResult):
        return result, None  # rebalance names the error
    load = metrics.gpu_loads(loads, Placement(result.phy2log, topology))
    first = metrics.imbalance(load)
    if result.groups_on_nodes and topology.num_nodes > 1:
        # The search keeps the first plan's groups on their nodes, so a layer's busiest node's
        # mean gpu load is a floor for it too (the search stops there as well).
        nodes = load.reshape(topology.num_layers, topology.num_nodes, -1).mean(axis=2).max(axis=1)
        mean = load.mean(axis=1)
        bound = np.maximum(bound, np.divide(nodes, mean, out=np.ones_like(mean), where=mean > 0))
    most = float(topology.num_gpus - 1)
    done, reach = near_bound(
        first, bound, float(opts.gap), min(migration.tolerance, most), min(migration.layer_tolerance, most)
    )
    rest = np.flatnonzero(~done)
    phy2log, notes = result.phy2log.copy(), result.notes
    left = None if deadline is None else deadline - time.perf_counter()
    over = left is not None and left <= 0
    # The full plan makes the first plan of its layers again before it searches: with less
    # time for it than that took (for auto, two first plans: an overestimate), no search.
    short = left is not None and FRESH_SHARE * left <= took * rest.size / topology.num_layers
    search = SearchStats(timed_out=over or (short and rest.size > 0), first_plan_over=over)
    if over:
        notes += ("time_limit ran out during the re-plan's first plan, which always runs whole: no search after it",)
    elif rest.size and short:
        notes += ("time_limit left too little time for a search after the re-plan's first plan",)
    elif rest.size:
        # The policy that planned the first plan (auto names the one it chose), so that every
        # layer keeps the same grouping.
        full_opts = opts if left is None else dataclasses.replace(opts, time_limit=FRESH_SHARE * left)
        full = get_policy(result.policy_used).fn(loads[rest], topology.with_layers(rest.size), full_opts)
        phy2log[rest] = full.phy2log
        search = search + full.search if full.search else search
        notes += full.notes
    fresh_imb = metrics.imbalance(metrics.gpu_loads(loads, Placement(phy2log, topology)))
    yardstick = np.where(done, reach, fresh_imb)
    return dataclasses.replace(result, phy2log=phy2log, notes=notes, search=search), yardstick


def rebalance(
    loads: object,
    topology: Topology,
    policy: str = "auto",
    previous: Placement | None = None,
    *,
    down_gpus: object = (),
    spread_nodes: bool = False,
    progress: Callable[[Progress], object] | None = None,
    **options: Any,
) -> Plan:
    """``loads``: ``[L, E]`` expert loads → a :class:`Plan` for ``topology``.

    ``policy`` names a registered policy (``policies()``); ``options`` are its options
    (``get_policy(policy).option_names()``). ``previous``, the placement in service now, is
    what ``Plan.moves`` counts against, and for policies registered with ``replans=True`` makes
    the plan keep experts where they are unless moving pays (``eplb.replan``; options
    ``tolerance``, ``layer_tolerance``, ``max_moves``, ``max_layer_moves``). Bad input raises
    ``ValueError``.

    ``down_gpus``: gpus that are down; the plan leaves their slots empty (-1) and places every
    expert on the live gpus, planned as the live gpus' own problem (``eplb.survivors``; the
    notes say how nodes were treated). With ``previous=`` the re-plan starts from ``previous``
    carried onto the live gpus: its experts lost with the down gpus restored on them, and the
    slots of gpus back up (down in ``previous``, not in ``down_gpus``) filled. Too few live
    slots for every expert raises ``ValueError`` before any work.

    A plan whose estimated memory (``eplb.limits.plan_bytes``) is above the limit
    (``eplb.limits.max_plan_bytes()``, 8 GiB unless raised with ``eplb.set_max_plan_bytes``)
    raises ``ValueError`` before anything that grows with the topology is allocated.

    ``spread_nodes``: after planning, swap one replica of each expert whose replicas are all on
    one node onto another node where a slot allows (``eplb.planner.spread``), so that a node
    failing loses fewer experts (``Plan.single_node``); it costs some balance and moves, and a
    hierarchical plan's groups are then no longer whole on nodes.

    ``progress``: called with an :class:`eplb.Progress` (layers done of the layers, phase,
    seconds since the call began) as chunks of layers finish, from this thread; it changes no
    placement. What it does with it (a bar, a log line) is the caller's.
    """
    check_callback(progress)
    called = time.perf_counter()
    time_given = {k: options.pop(k) for k in TIME_OPTIONS if k in options}
    timing = _time_options(time_given)
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
    if timing is not None and timing.top_k > topology.num_experts:
        raise ValueError(f"top_k ({timing.top_k}) must be at most num_experts ({topology.num_experts})")
    spec = get_policy(policy)
    # Before anything of the topology's size (the live slots, the loads' float64 copy): a plan
    # too large for the limit fails at once, not when the kernel kills the process. With gpus
    # down it is the live gpus' plan.
    check_plan_bytes(live_topology(topology, down_gpus), replan=previous is not None and spec.replans)
    live = survivors(topology, down_gpus)
    arr = check_loads(loads, topology)
    if previous is not None:
        if not isinstance(previous, Placement):
            raise ValueError(f"previous must be a Placement, got {type(previous).__name__}")
        if previous.topology != topology:
            raise ValueError(f"previous placement is for {previous.topology}, not {topology}")
    spec.parse(options)  # bad options fail before any work, with the policy's names
    bounds = [f.name for f in dataclasses.fields(Migration) if f.name in options]
    if bounds and previous is None:
        # They bound a re-plan's moves from previous; without it there is nothing to bound,
        # and planning as if they held would hide the caller's mistake.
        raise ValueError(
            f"{', '.join(bounds)} bound{'s' if len(bounds) == 1 else ''} a re-plan from the placement in "
            "service: give previous=Placement, or leave "
            f"{'it' if len(bounds) == 1 else 'them'} out for a fresh plan"
        )
    if not isinstance(spread_nodes, bool):
        raise ValueError(f"spread_nodes must be True or False, got {spread_nodes!r}")
    with reporting(progress):
        if live.down or (previous is not None and not previous.full):
            plan = _survivor_plan(arr, live, policy, previous, options)
        else:
            plan = _plan(arr, topology, spec, policy, previous, options)
        plan = _spread(plan, arr, previous) if spread_nodes else plan
        if timing is None:
            return plan
        limit = options.get("time_limit")
        deadline = None if limit is None else called + float(limit)
        fresh = None
        if previous is not None and (deadline is None or time.perf_counter() < deadline):
            # A re-plan's candidates for time: the fresh plan for time of the same loads too, which
            # _for_time weighs per layer against the re-plan and the placement in service.
            fresh_options = {k: v for k, v in options.items() if k not in _MIGRATION_FIELDS}
            if deadline is not None:
                fresh_options["time_limit"] = max(1e-3, deadline - time.perf_counter())
            fresh = rebalance(
                arr, topology, policy, down_gpus=down_gpus, spread_nodes=spread_nodes, **fresh_options, **time_given
            ).placement
        return _for_time(plan, arr, previous, timing, deadline, fresh, options)


# Policies whose fresh plans without redundant slots are settled (eplb.planner.settle): the
# replicate-and-pack family; deepseek stays eplb.py's, ilp the solver's.
_SETTLED = ("global", "hierarchical")

# rebalance's options for planning time rather than tokens (eplb.timing, eplb.planner.timeplan).
TIME_OPTIONS = ("kernel_curve", "tokens_per_gpu", "top_k", "dispatch")


@dataclasses.dataclass(frozen=True)
class _Timing:
    cost: CostModel
    batches: Batches
    top_k: int
    dispatch: str


def _time_options(given: dict[str, Any]) -> _Timing | None:
    """``kernel_curve``, ``tokens_per_gpu``, ``top_k``, ``dispatch`` checked (``ValueError`` says
    what each allows); ``None`` without a curve."""
    from .kernel import as_cost_model
    from .timing import DISPATCHES, batches_from

    if "kernel_curve" not in given:
        if given:
            raise ValueError(
                f"{', '.join(sorted(given))} plan for time and need kernel_curve= (a KernelModel, a shipped "
                "model's name, or a (tokens, microseconds) pair of arrays)"
            )
        return None
    cost = as_cost_model(given["kernel_curve"])
    missing = [k for k in ("tokens_per_gpu", "top_k") if k not in given]
    if missing:
        raise ValueError(f"kernel_curve= plans for time and needs {' and '.join(missing)}=")
    top_k = given["top_k"]
    checks.positive_int("top_k", top_k, "experts each token picks")
    dispatch = given.get("dispatch", "even")
    if dispatch not in DISPATCHES:
        raise ValueError(
            f"dispatch must be one of {', '.join(DISPATCHES)} (how the engine splits an expert's tokens over its "
            f"replicas: 'even' as vLLM's modulo, 'static' one replica per source rank as SGLang's); got {dispatch!r}"
        )
    return _Timing(cost, batches_from(given["tokens_per_gpu"]), int(top_k), str(dispatch))


_MIGRATION_FIELDS = tuple(f.name for f in dataclasses.fields(Migration))


def _for_time(
    plan: Plan,
    arr: np.ndarray,
    previous: Placement | None,
    timing: _Timing,
    deadline: float | None = None,
    fresh: Placement | None = None,
    options: dict[str, Any] | None = None,
) -> Plan:
    """``plan`` re-planned for expected MoE time (eplb.planner.timeplan), with ``predicted_ms``.

    With ``previous`` (a re-plan), each layer then takes, of the re-plan searched for time (no
    slot moved that the re-plan kept), ``fresh`` (the fresh plan for time) and ``previous`` (where
    its layer fits the live gpus), the one of fewest moves whose expected time is within the
    migration's ``layer_tolerance`` of the fastest, within the move budgets: a re-plan for time
    keeps what it can without giving back the time a fresh plan would win."""
    from .planner.timeplan import plan_for_time

    start = time.perf_counter()
    topology = plan.placement.topology
    live = plan.placement.live
    fresh_plan = plan.replan is None and previous is None
    deal = None
    if fresh_plan and topology.num_slots > topology.num_experts and live.all():
        # eplb.py's deal as a candidate where the model cannot tell layers apart (with redundant
        # slots; without, the token plan took it already: eplb.planner.settle.prefer_deal). On
        # real grouped kernels the token plan was 0.3-1.8 % slower than eplb.py at 256 tokens
        # per gpu though lighter in tokens (bench/moe_time_bench.py --kernels gpu, H100).
        hier = plan.policy_used == "hierarchical"
        groups, nodes = (topology.num_groups, topology.num_nodes) if hier else (1, 1)
        if not hier or groups % nodes == 0:
            deal = deepseek_rebalance(arr, topology.num_slots, groups, nodes, topology.num_gpus, exact_ranks=False)[0]
            # Only where its busiest gpu is within DEAL_SLACK of ours in tokens, as without
            # redundant slots: a plan for time keeps the token balance it was given.
            ours = metrics.gpu_loads(arr, plan.placement).max(axis=1)
            theirs = metrics.gpu_loads(arr, Placement(deal, topology)).max(axis=1)
            far = theirs > ours * (1.0 + DEAL_SLACK) + 1e-12 * np.maximum(ours, 1.0)
            deal = np.where(far[:, None], plan.phy2log, deal)
    phy, notes, per_layer = plan_for_time(
        arr,
        plan.phy2log,
        topology,
        cost=timing.cost,
        batches=timing.batches,
        top_k=timing.top_k,
        dispatch=timing.dispatch,
        live=live,
        previous=None if previous is None else previous.phy2log,
        fresh=fresh_plan,
        deadline=deadline,
        deal=deal,
    )
    if previous is not None:
        phy, per_layer, more = _replan_for_time(
            arr,
            phy,
            per_layer,
            previous,
            fresh,
            timing,
            Migration(**{k: v for k, v in (options or {}).items() if k in _MIGRATION_FIELDS}),
        )
        notes += more
    placement = Placement(phy, topology)
    load = metrics.gpu_loads(arr, placement)
    ms = per_layer.sum(axis=0) / 1000.0
    return dataclasses.replace(
        plan,
        placement=placement,
        imbalance=metrics.imbalance(load),
        balancedness=metrics.balancedness(load),
        moves=metrics.moves(previous, placement) if previous is not None else plan.moves,
        gpu_load=load,
        solve_seconds=plan.solve_seconds + time.perf_counter() - start,
        notes=plan.notes + notes,
        predicted_ms={int(b): round(float(m), 4) for b, m in zip(timing.batches.sizes, ms)},
    )


def _replan_for_time(
    arr: np.ndarray,
    phy: np.ndarray,
    per_layer: np.ndarray,
    previous: Placement,
    fresh: Placement | None,
    timing: _Timing,
    migration: Migration,
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Per layer, the candidate of fewest moves within ``layer_tolerance`` of the fastest (see
    ``_for_time``) → (``[L, P]``, ``[L, K]`` expected microseconds, notes)."""
    from .timing import predicted_layer_us

    topology = previous.topology
    w = timing.batches.weights
    args = (timing.cost, [(int(b), float(x)) for b, x in zip(timing.batches.sizes, w)], timing.top_k, timing.dispatch)
    pattern = phy >= 0
    cands = [("re-plan", phy, per_layer)]
    if fresh is not None:
        cands.append(("fresh", fresh.phy2log, predicted_layer_us(fresh, arr, *args)))
    # The placement in service, in the layers whose empty slots are the plan's (no gpu came back).
    prev_ok = (pattern == (previous.phy2log >= 0)).all(axis=1) & (previous.logcnt > 0).all(axis=1)
    if prev_ok.any():
        cands.append(("kept", previous.phy2log, predicted_layer_us(previous, arr, *args)))
    out, out_us = phy.copy(), per_layer.copy()
    budget = migration.max_moves
    taken = {name: 0 for name, *_ in cands}
    for layer in range(topology.num_layers):
        options = []
        for name, p, us in cands:
            if name == "kept" and not prev_ok[layer]:
                continue
            moves = int((p[layer] != previous.phy2log[layer]).sum())
            if migration.max_layer_moves is not None and moves > migration.max_layer_moves and name != "re-plan":
                continue
            if budget is not None and moves > budget and name != "re-plan":
                continue
            options.append((float((w * us[layer]).sum()), moves, name, p[layer], us[layer]))
        best = min(o[0] for o in options)
        t, moves, name, row, us = min(
            (o for o in options if o[0] <= best * (1 + migration.layer_tolerance) + 1e-12), key=lambda o: (o[1], o[0])
        )
        out[layer], out_us[layer] = row, us
        taken[name] += 1
        if budget is not None:
            budget = max(0, budget - moves)
    note = "re-planned for time: per layer the fewest moves within layer_tolerance of the fastest: " + ", ".join(
        f"{n} {c}" for n, c in taken.items()
    )
    return out, out_us, (note,)


def _spread(plan: Plan, arr: np.ndarray, previous: Placement | None) -> Plan:
    """``plan`` with hot experts' replicas spread over nodes (``rebalance(spread_nodes=True)``)."""
    start = time.perf_counter()
    topology = plan.placement.topology
    if topology.num_nodes == 1:
        return dataclasses.replace(plan, notes=plan.notes + ("spread_nodes: one node, nothing to spread",))
    phy, swaps = spread_over_nodes(arr, plan.phy2log, topology)
    placement = Placement(phy, topology)
    load = metrics.gpu_loads(arr, placement)
    moves = metrics.moves(previous, placement) if previous is not None else plan.moves
    imb = metrics.imbalance(load)
    note = (
        f"spread_nodes: {swaps} swaps put a replica of hot experts on a second node; experts on one node "
        # Not None: with one node _spread returned above.
        f"{int(plan.single_node.sum())} -> "  # type: ignore[union-attr]
        f"{int(((placement.logcnt >= 1) & _one_node(placement)).sum())}, "
        f"mean imbalance {plan.mean_imbalance:.4f} -> {float(imb.mean()):.4f}"
        + ("; expert groups are no longer whole on nodes" if plan.policy_used in ("hierarchical", "deepseek") else ""),
    )
    return dataclasses.replace(
        plan,
        placement=placement,
        imbalance=imb,
        balancedness=metrics.balancedness(load),
        moves=moves,
        gpu_load=load,
        solve_seconds=plan.solve_seconds + time.perf_counter() - start,
        notes=plan.notes + note,
    )


def _one_node(placement: Placement) -> np.ndarray:
    """bool ``[L, E]``: experts whose every replica is on one node."""
    topo = placement.topology
    l2p = placement.log2phy
    node = np.where(l2p >= 0, l2p // topo.slots_per_node, -1)
    return ((node == node[:, :, :1]) | (node < 0)).all(axis=2)


def _survivor_plan(
    arr: np.ndarray, live: Survivors, policy: str, previous: Placement | None, options: dict[str, Any]
) -> Plan:
    """``rebalance`` with gpus down (or ``previous`` holding empty slots): the live gpus' own
    problem planned by ``_plan``, then written back with -1 on the down gpus."""
    start = time.perf_counter()
    topology, red = live.topology, live.reduced
    notes, name = live.notes, policy
    if policy == "hierarchical" and not live.groups_on_nodes:
        name = "global"
        notes += ("hierarchical: expert groups cannot stay whole on the live nodes; planned with global over them",)
    elif policy == "hierarchical":
        notes += (f"hierarchical: expert groups kept whole on the {red.num_nodes} live nodes",)
    prev_red = None
    if previous is not None:
        kept = live.restrict(previous.phy2log)
        by_node = live.groups_on_nodes and name in ("hierarchical", "auto")
        full = restore(arr, kept, red, by_node)
        lost = int(((full != kept) & (kept >= 0)).sum())
        filled = int((kept < 0).sum())
        if lost or filled:
            notes += (
                f"previous carried onto the live gpus: {lost} slots given to experts left without a live "
                f"replica, {filled} empty slots filled",
            )
        prev_red = Placement(full, red)
    # At effort="fast" the carried placement's repairs aim at one target in one order (two with
    # two slots per gpu), not three in three, with half the count moves: fast plans are about time. Keeping the counts alone and leaving out the fresh
    # plan aligned cost too much balance where a node went down (survivor_bench, v3-decode-144:
    # 3.19 against the fast plan's 1.68).
    quick = options.get("effort") == "fast"
    inner = _plan(arr, red, get_policy(name), name, prev_red, options, quick)
    placement = Placement(live.expand(inner.phy2log), topology)
    load = metrics.gpu_loads(arr, placement)
    moves = (
        metrics.moves(previous, placement) if previous is not None else np.zeros(topology.num_layers, dtype=np.int64)
    )
    return dataclasses.replace(
        inner,
        placement=placement,
        policy=policy,
        imbalance=metrics.imbalance(load),
        balancedness=metrics.balancedness(load),
        moves=moves,
        gpu_load=load,
        solve_seconds=time.perf_counter() - start,
        notes=notes + inner.notes,
    )


def _plan(
    arr: np.ndarray,
    topology: Topology,
    spec: PolicySpec,
    policy: str,
    previous: Placement | None,
    options: dict[str, Any],
    quick: bool = False,
) -> Plan:
    """``rebalance`` on checked inputs, every slot of ``previous`` (if any) holding an expert;
    ``quick``: see ``eplb.replan.choose``."""
    opts, migration = spec.parse(options)
    start = time.perf_counter()
    # One deadline for the whole plan: first plans, search, and a re-plan's repairs.
    limit = opts.time_limit if isinstance(opts, PlanOptions) else None
    deadline = None if limit is None else start + float(limit)
    bound = metrics.imbalance_lb(arr, topology)
    reference = None
    if previous is not None and migration is not None and isinstance(opts, PlanOptions) and opts.effort != "fast":
        result, reference = _fresh_for_replan(spec, arr, topology, opts, migration, bound, deadline)
    else:
        result = spec.fn(arr, topology, opts)
    if not isinstance(result, PolicyResult):
        raise PolicyError(f"policy {policy!r} returned {type(result).__name__}, not a PolicyResult")
    try:
        fresh = Placement(result.phy2log, topology)
    except ValueError as exc:
        raise PolicyError(f"policy {policy!r} returned an invalid placement: {exc}") from None
    if not fresh.full:
        raise PolicyError(
            f"policy {policy!r} left {int((fresh.phy2log < 0).sum())} slots empty (-1): a policy fills every "
            "slot of the topology it is given (rebalance plans down gpus on the live gpus alone)"
        )
    phy2log, notes, replan = fresh.phy2log, result.notes, None
    if previous is None and topology.num_slots == topology.num_experts and result.policy_used in _SETTLED:
        # No redundant slots: spread the gpus under a pinned maximum (eplb.planner.settle).
        before = phy2log
        phy2log, _ = settle(arr, phy2log, topology.num_gpus, topology.num_gpus // topology.num_nodes)
        # Where tokens (nearly) tie, eplb.py's deal, whose MoE time is the reference
        # (eplb.planner.settle: in such layers ours was lighter in tokens and slower in time).
        # hierarchical keeps expert groups on nodes: it takes only eplb.py's hierarchical deal.
        hier = result.policy_used == "hierarchical"
        groups, nodes = (topology.num_groups, topology.num_nodes) if hier else (1, 1)
        dealt = np.zeros(topology.num_layers, dtype=bool)
        if not hier or groups % nodes == 0:
            phy2log, dealt = prefer_deal(arr, phy2log, topology.num_gpus, groups, nodes)
        spread = int(((phy2log != before).any(axis=1) & ~dealt).sum())
        notes += (
            f"no redundant slots: {int(dealt.sum())} of {topology.num_layers} layers take eplb.py's deal (its busiest "
            f"gpu within 1 % of ours in tokens); settle spread the gpus below the busiest in {spread} of the rest",
        )
    if previous is not None and migration is not None:
        # Options may say how many processes a re-plan's candidates use (PlanOptions.workers).
        workers = int(getattr(opts, "replan_workers", 1))
        by_node = result.groups_on_nodes
        # The re-plan's candidates are made for every layer at once (eplb.replan.candidates):
        # its progress is its start and its end.
        report("re-plan", 0, topology.num_layers)
        phy2log, replan, more = choose(
            arr, previous, phy2log, topology, migration, by_node, workers, reference, deadline, quick
        )
        notes += more
        report("re-plan", topology.num_layers, topology.num_layers)
    elif previous is not None:
        notes += (f"policy {policy!r} plans from scratch: moves are counted against previous, not kept low",)
    seconds = time.perf_counter() - start
    placement = Placement(phy2log, topology)
    load = metrics.gpu_loads(arr, placement)
    moves = (
        metrics.moves(previous, placement) if previous is not None else np.zeros(topology.num_layers, dtype=np.int64)
    )
    return Plan(
        placement=placement,
        policy=policy,
        policy_used=result.policy_used,
        imbalance=metrics.imbalance(load),
        imbalance_lb=bound,
        balancedness=metrics.balancedness(load),
        moves=moves,
        gpu_load=load,
        solve_seconds=seconds,
        notes=notes,
        search=result.search,
        replan=replan,
        solver=result.solver,
    )

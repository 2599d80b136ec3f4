"""``ilp``: the exact reference placement, one OR-Tools CP-SAT model per layer.

For small instances (tens of experts, a handful of gpus) it finds the placement whose busiest
gpu carries the least load, or the best one found within ``time_limit`` plus a proven bound.
It is what the fast policies are measured against (``bench/ilp_gap.py``), not a serving policy.

Model for one layer (``E`` experts, ``G`` gpus with ``S = P / G`` slots each):

- ``use[e, c]``: expert ``e`` gets ``c`` replicas, ``c`` in ``1 .. C`` with
  ``C = min(G, P - E + 1)``; exactly one ``c`` per expert. Enumerating the count keeps the
  per-replica load ``load_e / c`` a constant of each variable, so the model stays linear.
- ``y[e, c, g]``: gpu ``g`` holds a replica of ``e`` and ``e`` has ``c`` replicas.
  ``sum_g y[e, c, g] = c * use[e, c]``; ``sum_c y[e, c, g] <= 1`` (at most one replica of an
  expert per gpu); ``sum_{e, c} y[e, c, g] = S`` (every gpu full).
- ``load_g = sum_{e, c} w[e, c] * y[e, c, g] <= z``; minimise ``z``. ``w[e, c]`` is
  ``load_e / c`` in integer units (below).
- Symmetry: gpus are identical, so ``load_0 >= load_1 >= ... >= load_{G-1}``.
- Bounds: ``z`` at least the water-filling lower bound (``eplb.lower_bound``, computed on the
  integer weights) and at most the ``global`` policy's answer, which is also the hint.

Small layers (at most 200,000 replica-count vectors and 20,000 ways to fill one gpu) go first
to an exact enumeration (``eplb.enumeration``) with half the time limit: it settles
them in about a second, including float loads whose optimum sits a hair above the mean gpu
load, where CP-SAT's bound stays at the mean. What it does not settle, CP-SAT solves with the
rest of the time, hinted with the enumeration's best placement.

Integer units: with integer loads and ``max(load) * lcm(1..C)`` small enough, ``w[e, c] =
load_e * lcm / c`` is exact and OPTIMAL means optimal. Otherwise loads are scaled so the
largest is ``2**24`` units and rounded; each slot's weight is then off by at most half a unit,
a gpu's load by at most ``S / 2`` units, so the plan is within ``S`` units of the true optimum
and the reported bound subtracts ``S / 2`` units to stay a true bound.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checks
from ..bounds import integer_bound
from ..enumeration import improve_or_prove
from ..metrics import gpu_loads, lower_bound
from ..placement import Placement
from ..planner.anytime import place_global
from ..progress import report
from ..registry import PolicyResult, register_policy
from ..result import SolverStats
from ..topology import Topology

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["solve_layer", "IlpOptions"]

# Largest integer weight we accept for exact units; beyond it CP-SAT's linear relaxation gets
# numerically weaker and int64 sums over a gpu start to approach their limits.
_EXACT_MAX = 1 << 40
# Units of the largest expert load when loads must be rounded.
_ROUNDED_UNITS = float(1 << 24)


@dataclass(frozen=True)
class IlpOptions:
    """Options of the ``ilp`` policy, checked when made: ``time_limit`` (seconds per layer),
    ``workers`` (CP-SAT search workers), ``total_time_limit`` (seconds for all layers,
    ``None``: no limit; each layer gets at most what is left over the layers left,
    ``time_limit`` at most, and one that runs out keeps the global policy's placement) and
    ``progress`` (called as ``progress(layers_done, num_layers)`` after each layer)."""

    time_limit: float = 10.0
    workers: int = 8
    total_time_limit: float | None = None

    def __post_init__(self) -> None:
        checks.positive_number("time_limit", self.time_limit, allowed="a positive number of seconds")
        checks.positive_int("workers", self.workers, allowed="a positive integer")
        if self.total_time_limit is not None:
            checks.positive_number(
                "total_time_limit", self.total_time_limit, allowed="a positive number of seconds or None"
            )


def _units(loads: np.ndarray, max_count: int) -> tuple[np.ndarray, float, bool]:
    """``loads``: ``[E]`` → ``w [E, C]`` int64 weights of one replica, the scale, and exactness."""
    counts = np.arange(1, max_count + 1)
    lcm = math.lcm(*counts.tolist())
    top = float(loads.max(initial=0.0))
    if np.all(loads == np.round(loads)) and top * lcm <= _EXACT_MAX:
        ints = loads.astype(np.int64) * lcm
        return ints[:, None] // counts[None, :], float(lcm), True
    scale = _ROUNDED_UNITS / top if top > 0 else 1.0
    return np.round(loads[:, None] * scale / counts[None, :]).astype(np.int64), scale, False


def solve_layer(
    loads: np.ndarray,
    topology: Topology,
    hint: np.ndarray | None = None,
    *,
    time_limit: float = 10.0,
    workers: int = 8,
    deadline: float | None = None,
) -> dict[str, Any]:
    """``loads``: ``[E]`` one layer; ``hint``: ``[P]`` a valid ``phy2log`` row → the solve.

    Returns ``phy2log`` int32 ``[P]`` (``hint`` when the solver found nothing), ``status``
    (``OPTIMAL``, ``FEASIBLE`` or ``UNKNOWN``), ``bound`` (proven lower bound on the busiest
    gpu's load, in load units), ``objective`` (the busiest gpu's load of the returned row, in
    load units as the solver counts them), ``exact``, ``seconds`` and ``method``
    (``"enumeration"`` when the exact enumeration of ``enumeration`` settled it within half of
    ``time_limit``, else ``"cp-sat"``).

    ``deadline`` (a ``time.perf_counter()`` value) also bounds building the model, which at
    full scale takes longer than the solve: past it the layer keeps ``hint`` (status
    ``UNKNOWN``, method ``"out of time"``). Without it only the solve is limited.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        # One line to act on: the chained "No module named 'ortools'" says nothing more.
        # name= lets a caller tell which module is missing, as for any ImportError.
        raise ImportError(
            "policy 'ilp' needs OR-Tools (CP-SAT); install it with: pip install 'eplb[ilp]'", name="ortools"
        ) from None

    E, P, G = topology.num_experts, topology.num_slots, topology.num_gpus
    S = topology.slots_per_gpu
    C = min(G, P - E + 1)
    w, scale, exact = _units(loads, C)
    lb = integer_bound(w, P, G)
    start = time.perf_counter()
    # Small layers: the exact enumeration first (half the time); it proves what CP-SAT's
    # bound often cannot, and otherwise hands CP-SAT a better hint.
    incumbent = _hint_units(hint, w, topology)
    if incumbent is not None and incumbent > lb:
        done, best, better = improve_or_prove(w, G, S, incumbent, deadline=start + time_limit / 2)
        if better is not None:
            hint = better
        if done:
            slack = 0.0 if exact else S / 2
            return {
                "phy2log": np.asarray(hint, dtype=np.int32),
                "status": "OPTIMAL",
                "bound": max(0.0, (best - slack) / scale),
                "objective": best / scale,
                "exact": exact,
                "seconds": time.perf_counter() - start,
                "method": "enumeration",
            }
    time_limit = max(time_limit - (time.perf_counter() - start), 0.01)

    def out_of_time() -> dict[str, Any] | None:
        if deadline is None or time.perf_counter() < deadline:
            return None
        if hint is None:
            raise ValueError("policy 'ilp' ran out of time while building its model; raise the time limit")
        return {
            "phy2log": np.asarray(hint, dtype=np.int32),
            "status": "UNKNOWN",
            "bound": max(0.0, (lb - (0.0 if exact else S / 2)) / scale),
            "objective": float("nan"),
            "exact": exact,
            "seconds": time.perf_counter() - start,
            "method": "out of time",
        }

    # Zero-weight (e, c) pairs are common (idle experts); they still take slots.
    model = cp_model.CpModel()
    use = [[model.NewBoolVar(f"use_{e}_{c + 1}") for c in range(C)] for e in range(E)]
    y = []
    for e in range(E):  # building checks the deadline once per expert / gpu
        if late := out_of_time():
            return late
        y.append([[model.NewBoolVar(f"y_{e}_{c + 1}_{g}") for g in range(G)] for c in range(C)])
    for e in range(E):
        if late := out_of_time():
            return late
        model.AddExactlyOne(use[e])
        for c in range(C):
            model.Add(sum(y[e][c]) == (c + 1) * use[e][c])
        for g in range(G):
            model.AddAtMostOne(y[e][c][g] for c in range(C))
    hi = int(w.max(initial=0)) * S
    gpu_load = [model.NewIntVar(0, hi, f"load_{g}") for g in range(G)]
    z = model.NewIntVar(lb, max(lb, hi), "z")
    for g in range(G):
        if late := out_of_time():
            return late
        model.Add(sum(y[e][c][g] for e in range(E) for c in range(C)) == S)
        model.Add(gpu_load[g] == sum(int(w[e, c]) * y[e][c][g] for e in range(E) for c in range(C)))
        model.Add(gpu_load[g] <= z)
    # Gpus are identical: put the heaviest expert's c replicas on gpus 0 .. c-1, then order
    # loads within each of the two blocks (a pair straddles the blocks when c == g + 1).
    h = int(np.argmax(loads))
    for c in range(C):
        for g in range(G):
            model.AddImplication(use[h][c], y[h][c][g] if g <= c else y[h][c][g].Not())
    for g in range(G - 1):
        ordered = model.Add(gpu_load[g] >= gpu_load[g + 1])
        if g < C:
            ordered.OnlyEnforceIf(use[h][g].Not())
    # The total is fixed by the counts alone; stating it helps the linear relaxation.
    model.Add(sum(gpu_load) == sum(int((c + 1) * w[e, c]) * use[e][c] for e in range(E) for c in range(C)))

    hint_value = None
    if late := out_of_time():
        return late
    if hint is not None:
        hint_value = _add_hint(model, hint, w, use, y, gpu_load, z, topology)
        if hint_value is not None:
            model.Add(z <= hint_value)
    model.Minimize(z)
    if late := out_of_time():
        return late
    if deadline is not None:
        time_limit = max(min(time_limit, deadline - time.perf_counter()), 0.01)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = int(workers)
    # CP-SAT's own SIGINT handler would end only this layer's search and swallow Ctrl-C, so the
    # run went on. Without it Python's handler runs when the solve returns (within the layer's
    # time limit), where a caller's handler can record it (eplb place stops between layers).
    solver.parameters.catch_sigint_signal = False
    status = solver.Solve(model)
    seconds = time.perf_counter() - start
    # ortools annotates Solve() as returning the CpSolverStatus class, not its ValueType (an int, as
    # OPTIMAL and FEASIBLE are): the lookup is right, the stub is not.
    name = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE"}.get(status, "UNKNOWN")  # type: ignore[call-overload]
    bound_units = float(solver.BestObjectiveBound()) if name != "UNKNOWN" else float(lb)
    # Rounded units may undercount a gpu by S / 2 units; subtract it to keep the bound true.
    slack = 0.0 if exact else S / 2
    bound = max(0.0, (bound_units - slack) / scale)
    if name == "UNKNOWN":
        if hint is None:
            raise ValueError("policy 'ilp' found no placement within time_limit; raise time_limit")
        row = np.asarray(hint, dtype=np.int32)
        objective = float("nan")
    else:
        holds = np.any(
            np.array([[[solver.BooleanValue(y[e][c][g]) for c in range(C)] for g in range(G)] for e in range(E)]),
            axis=2,
        )  # [E, G]
        # Each gpu's experts in ascending order, gpus in solver order: slots are gpu-major.
        row = np.concatenate([np.flatnonzero(holds[:, g]) for g in range(G)]).astype(np.int32)
        objective = float(solver.ObjectiveValue()) / scale
    return {
        "phy2log": row,
        "status": name,
        "bound": bound,
        "objective": objective,
        "exact": exact,
        "seconds": seconds,
        "method": "cp-sat",
    }


def _hint_units(hint: np.ndarray | None, w: np.ndarray, topology: Topology) -> int | None:
    """The busiest gpu of ``hint`` (``[P]``) in integer units, or ``None`` without a valid hint
    (none given, or two replicas of an expert on one gpu, which the model forbids)."""
    if hint is None:
        return None
    per_gpu = np.asarray(hint).reshape(topology.num_gpus, topology.slots_per_gpu)
    srt = np.sort(per_gpu, axis=1)
    counts = np.bincount(per_gpu.ravel(), minlength=topology.num_experts)
    if (srt[:, 1:] == srt[:, :-1]).any() or counts.max() > w.shape[1]:
        return None
    return int(w[per_gpu, counts[per_gpu] - 1].sum(axis=1).max())


def _add_hint(
    model: cp_model.CpModel,
    hint: np.ndarray,
    w: np.ndarray,
    use: list[list[cp_model.IntVar]],
    y: list[list[list[cp_model.IntVar]]],
    gpu_load: list[cp_model.IntVar],
    z: cp_model.IntVar,
    topology: Topology,
) -> int | None:
    """Hint ``hint`` (``[P]``) with gpus relabelled to satisfy the symmetry order; its value.

    Returns ``None`` (no hint) when ``hint`` puts two replicas of an expert on one gpu, which
    the model forbids.
    """
    E, G, S = topology.num_experts, topology.num_gpus, topology.slots_per_gpu
    per_gpu = np.asarray(hint).reshape(G, S)
    srt = np.sort(per_gpu, axis=1)
    if (srt[:, 1:] == srt[:, :-1]).any():
        return None
    counts = np.bincount(per_gpu.ravel(), minlength=E)
    load = w[per_gpu, counts[per_gpu] - 1].sum(axis=1)
    # The model's gpu order: gpus holding the heaviest expert first, each block by load.
    h = int(np.argmax(w[:, 0]))
    order = np.lexsort((-load, ~(per_gpu == h).any(axis=1)))
    for e in range(E):
        for c in range(len(use[e])):
            model.AddHint(use[e][c], int(counts[e] == c + 1))
    for new_g, old_g in enumerate(order):
        held = set(per_gpu[old_g].tolist())
        for e in range(E):
            for c in range(len(use[e])):
                model.AddHint(y[e][c][new_g], int(e in held and counts[e] == c + 1))
        model.AddHint(gpu_load[new_g], int(load[old_g]))
    model.AddHint(z, int(load.max()))
    return int(load.max())


@register_policy("ilp", options=IlpOptions)
def _ilp(loads: np.ndarray, topology: Topology, options: IlpOptions) -> PolicyResult:
    """``loads``: float64 ``[L, E]`` → the min-max placement of each layer by CP-SAT (see
    ``IlpOptions``). Fills ``Plan.solver`` (``SolverStats``: status, bound, objective, seconds
    and method per layer)."""
    time_limit, workers, total = options.time_limit, options.workers, options.total_time_limit
    end = None if total is None else time.perf_counter() + float(total)
    t = topology
    if t.num_experts * t.num_gpus < t.num_slots:
        raise ValueError(
            f"policy 'ilp' keeps at most one replica of an expert per gpu, so num_slots ({t.num_slots}) "
            f"must be <= num_experts x num_gpus ({t.num_experts * t.num_gpus})"
        )
    hints = place_global(loads, t)
    rows, status, bound, objective, seconds, method = [], [], [], [], [], []
    notes: list[str] = []
    one = t.with_layers(1)
    for layer in range(t.num_layers):  # one CP-SAT solve per layer; the solve dominates
        limit, deadline = float(time_limit), None
        if end is not None:  # this layer's share of what is left
            left = end - time.perf_counter()
            share = max(left, 0.0) / (t.num_layers - layer)
            limit, deadline = max(min(limit, share), 0.01), time.perf_counter() + min(limit, share)
        if end is not None and left <= 0:
            # Past the overall limit a layer keeps its hint without a solve: the units, the
            # bound and the enumeration's minimum slice cost 10-20 ms a layer, 1 s over a
            # 6 s limit at v3-prefill (its bound is the water-filling one, added below).
            out = {"phy2log": hints[layer], "status": "UNKNOWN", "bound": 0.0, "objective": float("nan")}
            out |= {"seconds": 0.0, "method": "out of time"}
        else:
            out = solve_layer(loads[layer], one, hints[layer], time_limit=limit, workers=workers, deadline=deadline)
        rows.append(out["phy2log"])
        status.append(out["status"])
        bound.append(out["bound"])
        objective.append(out["objective"])
        seconds.append(out["seconds"])
        method.append(out["method"])
        report("ilp", layer + 1, t.num_layers)
    # Say where the search bought nothing over its hint, the fast policy's plan.
    busiest = [gpu_loads(loads, Placement(np.stack(r), t)).max(axis=1) for r in (rows, list(hints))]
    same = ~(busiest[0] < busiest[1] * (1 - 1e-9))
    proved = int((same & (np.array(status) == "OPTIMAL")).sum())
    unknown = np.array(status) == "UNKNOWN"
    for keeps, layers in (
        ("the global policy's placement", unknown & same),
        ("the better one the exact enumeration found first", unknown & ~same),
    ):
        if layers.any():
            notes.append(
                f"ilp: {int(layers.sum())} of {t.num_layers} layers found no solution in their time "
                f"(layers {_ranges(np.flatnonzero(layers).tolist())}); they keep {keeps}"
            )
    if same.any():
        notes.append(
            f"ilp: found nothing better than the global policy's placement on {int(same.sum())} of "
            f"{t.num_layers} layers" + (f" ({proved} of them proved optimal)" if proved else "")
        )
    if rows and not _exact_all(loads, t):
        notes.append(
            "ilp: loads were rounded to integer units; plans are optimal to within slots_per_gpu / 2**24 of the largest load"
        )
    # The water-filling bound holds for the true loads; the solver's may lose S / 2 units to rounding.
    bound_all = np.maximum(np.array(bound), lower_bound(loads, t))
    solver = SolverStats(tuple(status), bound_all, np.array(objective), np.array(seconds), tuple(method))
    return PolicyResult(np.stack(rows), "ilp", tuple(notes), solver=solver)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``: a note that stays one line at 58 layers."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _exact_all(loads: np.ndarray, topology: Topology) -> bool:
    C = min(topology.num_gpus, topology.num_slots - topology.num_experts + 1)
    return all(_units(row, C)[2] for row in loads)

"""The best busiest gpu any replica counts allow at two slots per gpu, bracketed by CP-SAT
(``pair_optimum``'s method; ``shapes_bench --optimum`` uses it too). Needs ortools (the
``ilp`` extra) when called."""

from __future__ import annotations

import numpy as np

from eplb.planner.pairing import paired_max


def feasible(loads: np.ndarray, T: float, bins: int, cap: int, time_limit: float) -> np.ndarray | None | str:
    """``loads`` ``[E]``: counts reaching ``T``, ``None`` when CP-SAT proves none does, or
    ``"unknown"`` when it ran out of time."""
    from ortools.sat.python import cp_model

    E = loads.size
    opts = []  # (expert, count, replica size)
    for e in range(E):
        lo = max(1, int(np.ceil(loads[e] / T - 1e-12)))
        hi = min(cap, max(lo, int(np.ceil(2 * loads[e] / T - 1e-12))) + 1)
        opts += [(e, c, loads[e] / c) for c in range(lo, hi + 1)]
    m = cp_model.CpModel()
    x = [m.NewBoolVar("") for _ in opts]
    by_expert: list[list] = [[] for _ in range(E)]
    for i, (e, _, _) in enumerate(opts):
        by_expert[e].append(x[i])
    for e in range(E):
        if not by_expert[e]:
            return None
        m.AddExactlyOne(by_expert[e])
    m.Add(sum(c * x[i] for i, (_, c, _) in enumerate(opts)) == 2 * bins)
    # The conditions change only at replica sizes: y = p (p >= T/2) and y = T - p (p <= T/2).
    ys = {p for _, _, p in opts if p >= T / 2} | {T - p for _, _, p in opts if p <= T / 2}
    for y in sorted(ys):
        terms = []
        for i, (_, c, p) in enumerate(opts):
            k = (c if p >= y * (1 - 1e-12) else 0) + (c if p >= (T - y) * (1 - 1e-12) else 0)
            if k:
                terms.append(k * x[i])
        if terms:
            m.Add(sum(terms) <= 2 * bins)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    status = solver.Solve(m)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        out = np.zeros(E, dtype=np.int64)
        for i, (e, c, _) in enumerate(opts):
            if solver.Value(x[i]):
                out[e] = c
        return out
    return "unknown" if status == cp_model.UNKNOWN else None


def bracket(
    row: np.ndarray, bins: int, cap: int, lo: float, hi: float, steps: int, time_limit: float
) -> tuple[float, float]:
    """``row`` ``[E]`` loads in mean bins → ``(lo, hi)``: bisection between a known bound ``lo``
    and a reached busiest bin ``hi``; ``lo`` proven impossible by CP-SAT, ``hi`` reached."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = feasible(row, mid, bins, cap, time_limit)
        if isinstance(got, str):
            break  # CP-SAT ran out of time: lo stays the last target proven impossible
        if got is None:
            lo = mid
        else:
            hi = min(mid, float(paired_max(row[None], got[None])[0]))
    return lo, hi

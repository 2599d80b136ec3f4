"""The best busiest gpu any replica counts allow at two slots per gpu, proven by CP-SAT.

    python -m eplb_bench.pair_optimum [--cases NAME,...] [--layers 0] [--steps 7] [--time-limit 20]

With two replicas per gpu, counts ``c`` reach a busiest gpu of at most ``T`` (replicas sorted
and paired i-th heaviest with i-th lightest; two replicas of one expert meeting is ignored,
which only relaxes it) iff for every ``y`` in ``[T/2, T]`` the replicas of at least ``y`` and
those of at least ``T - y`` number at most ``2 * gpus`` together (a replica of at least ``y``
needs a partner below ``T - y``). Those conditions are linear in one boolean per (expert,
count), so CP-SAT decides a ``T`` exactly; bisection between the mean gpu and the default
plan's busiest gpu brackets the optimum of each layer: ``lo`` is proven impossible, ``hi``
reached (by counts whose pairing is reported). Rows of ``eplb_bench.default_bench`` at two
slots per gpu; under zipf every layer has the same sorted loads, so layer 0 speaks for all.
Needs ortools (the ``ilp`` extra).
"""

from __future__ import annotations

import argparse

import numpy as np

import eplb
from eplb.place.pairing import paired_max
from eplb.place.replicate import replica_cap

from .default_bench import cases


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", help="comma-separated default_bench case names (default: the 256e/192gpu rows)")
    ap.add_argument("--layers", default="0", help="comma-separated layer indices (default 0)")
    ap.add_argument("--steps", type=int, default=7, help="bisection steps (default 7)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per target (default 20)")
    args = ap.parse_args(argv)
    table = cases()
    names = args.cases.split(",") if args.cases else [n for n in table if n.startswith("256e/192gpu/2spg")]
    print(f"{'case':34} {'layer':>5} {'default':>8} {'lo':>8} {'hi':>8}")
    for name in names:
        t, loads, policy = table[name]()
        if t.slots_per_gpu != 2:
            raise SystemExit(f"{name}: not two slots per gpu")
        plan = eplb.rebalance(loads, t, policy)
        for layer in map(int, args.layers.split(",")):
            row = loads[layer] / (loads[layer].sum() / t.num_gpus)  # in mean gpus
            default = float(plan.gpu_load[layer].max() / (loads[layer].sum() / t.num_gpus))
            cap = replica_cap(t.num_experts, t.num_slots, t.num_gpus)
            lo, hi = bracket(row, t.num_gpus, cap, 1.0, default, args.steps, args.time_limit)
            print(f"{name:34} {layer:5d} {default:8.4f} {lo:8.4f} {hi:8.4f}", flush=True)


if __name__ == "__main__":
    main()

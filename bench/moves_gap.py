"""How many more slots a migration-aware re-plan moves than the fewest possible, on small layers.

    python -m eplb_bench.moves_gap [--seeds 5] [--time-limit 20] [--tolerance 0.01] [--json out.json]

Each instance is one layer: a `global` plan of lognormal(σ=1) loads, then the loads times one
step of lognormal drift noise (σ = 0.05 or 0.2). The re-plan must bring the busiest gpu to
within ``(1 + tolerance)`` of a fresh plan's. Three figures, in slots rewritten:

- ours: ``eplb.rebalance(previous=..., tolerance=t, layer_tolerance=t)``;
- the optimum: CP-SAT over every placement (replica counts free within one replica per gpu,
  every expert at least one), minimising rewritten slots; where it does not prove optimality
  in the time limit its best value and bound are given;
- the counts-kept floor of ``drift_bench`` (any re-plan that keeps replica counts needs that
  many): when the optimum is below it, changing counts paid.

Needs OR-Tools (``pip install 'eplb[ilp]'``).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import eplb
from eplb.planner.replicate import replica_cap
from eplb.workloads import make_loads

from .harness.floors import kept_count_floor

# (experts, gpus, slots per gpu): the last is kimi-64's shape (7 slots per gpu, 6/7 experts per slot).
TOPOLOGIES: tuple[tuple[int, int, int], ...] = ((16, 4, 5), (32, 8, 5), (24, 4, 7), (48, 8, 7))
SIGMAS = (0.05, 0.2)
_SCALE = 1e6  # loads in units of 1e-6 of a gpu's mean load: rounding far below any gap that counts


def fewest_moves(w: np.ndarray, prev: np.ndarray, cap: int, limit: float, time_limit: float, hint: np.ndarray) -> dict:
    """``w`` ``[E]`` loads, ``prev`` ``[G, S]`` experts per gpu, ``limit`` the busiest gpu's load
    allowed → the fewest slots any placement rewrites to get there (CP-SAT), seeded with
    ``hint`` ``[G, S]``."""
    from ortools.sat.python import cp_model

    G, S = prev.shape
    E = w.size
    unit = _SCALE * G / w.sum()
    m = cp_model.CpModel()
    x = [[m.NewBoolVar(f"x{e}_{g}") for g in range(G)] for e in range(E)]
    load: list[list] = [[] for _ in range(G)]
    for e in range(E):
        counts = range(1, min(cap, G) + 1)
        y = [m.NewBoolVar(f"y{e}_{c}") for c in counts]
        m.AddExactlyOne(y)
        m.Add(sum(x[e]) == sum(c * yc for c, yc in zip(counts, y)))
        for g in range(G):
            for c, yc in zip(counts, y):
                # z >= x and y: a replica of e on g at count c carries w / c (the limit is an
                # upper bound, so z is never 1 without both).
                z = m.NewBoolVar("")
                m.AddBoolOr([x[e][g].Not(), yc.Not(), z])
                load[g].append(int(round(w[e] / c * unit)) * z)
    cap_units = int(np.floor(limit * unit)) + S  # one unit of rounding per slot
    for g in range(G):
        m.Add(sum(x[e][g] for e in range(E)) == S)
        m.Add(sum(load[g]) <= cap_units)
    kept = [x[e][g] for g in range(G) for e in set(prev[g].tolist())]
    m.Maximize(sum(kept))
    for g in range(G):
        held = set(hint[g].tolist())
        for e in range(E):
            m.AddHint(x[e][g], int(e in held))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 2
    status = solver.Solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return {"status": solver.StatusName(status)}
    return {
        "status": solver.StatusName(status),
        "moves": int(round(G * S - solver.ObjectiveValue())),
        "bound": int(np.ceil(G * S - solver.BestObjectiveBound() - 1e-6)),
    }


def instance(
    experts: int, gpus: int, per_gpu: int, sigma: float, seed: int, tolerance: float, time_limit: float
) -> dict:
    topo = eplb.Topology(1, experts, gpus * per_gpu, gpus)
    base = make_loads("lognormal-1.0", topo, seed)
    loads = base * np.random.default_rng(seed + 1000).lognormal(0.0, sigma, base.shape)
    prev = eplb.rebalance(base, topo, "global").placement
    fresh = eplb.rebalance(loads, topo, "global")
    ours = eplb.rebalance(loads, topo, "global", previous=prev, tolerance=tolerance, layer_tolerance=tolerance)
    limit = (1 + tolerance) * float(fresh.gpu_load.max())
    items = (loads / prev.logcnt)[0, prev.phy2log[0]].reshape(1, gpus, per_gpu)
    cap = replica_cap(experts, gpus * per_gpu, gpus) or 1
    best = fewest_moves(
        loads[0],
        prev.phy2log[0].reshape(gpus, per_gpu),
        cap,
        limit * (1 + 1e-12),
        time_limit,
        ours.placement.phy2log[0].reshape(gpus, per_gpu),
    )
    return {
        "experts": experts,
        "gpus": gpus,
        "slots": gpus * per_gpu,
        "sigma": sigma,
        "seed": seed,
        "over": int((eplb.gpu_loads(loads, prev)[0] > limit).sum()),
        "ours": int(ours.total_moves),
        "ours_ok": bool(ours.gpu_load.max() <= limit * (1 + 1e-9)),
        "floor": kept_count_floor(items, fresh.gpu_load.max(axis=1), fresh.imbalance, tolerance),
        **{f"ilp_{k}": v for k, v in best.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [
        instance(e, g, s, sigma, seed, args.tolerance, args.time_limit)
        for (e, g, s) in TOPOLOGIES
        for sigma in SIGMAS
        for seed in range(args.seeds)
    ]
    print("| experts / gpus / slots | drift | gpus over | counts-kept floor | fewest (proved) | ours | ours / fewest |")
    print("|---|---|---|---|---|---|---|")
    for e, g, s in TOPOLOGIES:
        for sigma in SIGMAS:
            rs = [r for r in rows if (r["experts"], r["gpus"], r["sigma"]) == (e, g, sigma) and "ilp_moves" in r]
            if not rs:
                continue
            proved = sum(r["ilp_status"] == "OPTIMAL" for r in rs)
            fewest = sum(r["ilp_moves"] for r in rs)
            ours = sum(r["ours"] for r in rs)
            print(
                f"| {e} / {g} / {g * s} | {sigma} | {np.mean([r['over'] for r in rs]):.1f} | "
                f"{np.mean([r['floor'] for r in rs]):.1f} | {fewest / len(rs):.1f} ({proved}/{len(rs)}) | "
                f"{ours / len(rs):.1f} | {ours / max(fewest, 1):.2f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

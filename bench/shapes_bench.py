"""The default plan on realistic routing-count shapes at 1.5-2 slots per gpu, against the bounds.

    python -m eplb_bench.shapes_bench [--shapes NAME,...] [--layers 16] [--repeat 1] [--jobs 1]
                                      [--optimum N] [--json out.json]

Real routing traces of production models differ from the smooth seeded workloads of
``default_bench``: counts come from a window of a few thousand tokens, so they are small
integers with ties and zeros; some experts are dead; layers differ in skew, and a few experts
take several percent of a layer (one can take 10 % or more). This suite builds such loads:
per layer an expert popularity (zipf or lognormal over a random permutation, some experts at
0), a few hot experts that a token picks with a fixed probability, and ``tokens`` tokens each
routed to 8 distinct experts (the hot ones it picks, then the rest drawn without replacement
by popularity: Gumbel top-k); the load is the integer count per expert, passed as int64.

Topologies: 128 experts on 128 gpus with 256 slots, 256 on 256 with 512 and 256 on 192 with
384 (the shapes real traces are checked on). For every shape: mean imbalance over layers of
``deepseek`` (eplb.py), the first plan (``effort="fast"``), the default, ``effort="high"``,
the plan's lower bound (``imbalance_lb``), at two slots per gpu the profile bound ("prof"),
with ``--optimum N`` the CP-SAT bracket of the best counts on the first N layers ("cp lo/hi",
``bench/pair_optimum.py``; two slots per gpu, needs ortools) next to the default on the same
layers ("def@cp"), and the default's median solve time. "gap" is the default over ``high``,
"room" the default over the better bound: where it is large the bound or the search is short.
``--jobs`` runs shapes in parallel processes (timings are then per process, not per machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor

import numpy as np

import eplb
from eplb.bounds import profile_bound
from eplb.planner.replicate import replica_cap

from .harness.cases import select
from .harness.optimum import bracket
from .harness.shapes import SHAPES, Shape, make_shape

TOPOLOGIES: dict[str, tuple[int, int, int]] = {  # name → (experts, slots, gpus)
    "128e/128gpu": (128, 256, 128),
    "256e/256gpu": (256, 512, 256),
    "256e/192gpu": (256, 384, 192),
}


def cases(num_layers: int) -> dict[str, tuple[eplb.Topology, Shape, int]]:
    """Name → (topology, shape, seed); loads are drawn when measured."""
    out = {}
    for i, (tname, (E, P, G)) in enumerate(TOPOLOGIES.items()):
        for j, (sname, shape) in enumerate(SHAPES.items()):
            out[f"{tname} {sname}"] = (eplb.Topology(num_layers, E, P, G), shape, 1000 * i + j)
    return out


def _optimum(loads: np.ndarray, plan: eplb.Plan, t: eplb.Topology, layers: int) -> tuple[float, float, float]:
    """Means over the first ``layers`` layers of the CP-SAT bracket (``lo`` proven impossible,
    ``hi`` reached by some counts) of the best busiest gpu, in mean gpus, and of the plan's."""
    los, his, got = [], [], []
    cap = replica_cap(t.num_experts, t.num_slots, t.num_gpus)
    for layer in range(min(layers, t.num_layers)):
        mean = loads[layer].sum() / t.num_gpus
        if mean == 0:
            continue
        row = loads[layer] / mean
        lo = float(plan.imbalance_lb[layer])
        hi = float(plan.gpu_load[layer].max() / mean)
        lo, hi = bracket(row, t.num_gpus, cap, lo, hi, steps=6, time_limit=10.0)
        los.append(lo)
        his.append(min(hi, float(plan.imbalance[layer])))
        got.append(float(plan.imbalance[layer]))
    return float(np.mean(los)), float(np.mean(his)), float(np.mean(got))


def measure(name: str, num_layers: int, repeat: int, optimum: int) -> dict:
    t, shape, seed = cases(num_layers)[name]
    loads = make_shape(shape, num_layers, t.num_experts, seed)
    row: dict = {"name": name}
    for key, pol, opts in (
        ("deepseek", "deepseek", {}),
        ("fast", "global", {"effort": "fast"}),
        ("default", "global", {}),
        ("high", "global", {"effort": "high"}),
    ):
        secs, plan = [], None
        for _ in range(repeat if key == "default" else 1):
            plan = eplb.rebalance(loads, t, pol, **opts)
            secs.append(plan.solve_seconds)
        row[key] = plan.mean_imbalance
        row[f"{key}_s"] = statistics.median(secs)
        if key == "default":
            default_plan = plan
    p = default_plan
    mean = loads.sum(axis=1) / t.num_gpus
    live = mean > 0
    lb = p.imbalance_lb * mean
    row["bound"] = float(p.imbalance_lb[live].mean())
    row["profile"] = row["bound"]
    if t.slots_per_gpu == 2:
        cap = replica_cap(t.num_experts, t.num_slots, t.num_gpus)
        prof = np.maximum(lb, profile_bound(loads.astype(np.float64), t.num_gpus, cap, lb, p.gpu_load.max(axis=1)))
        row["profile"] = float((prof[live] / mean[live]).mean())
    row["cp_lo"] = row["cp_hi"] = row["cp_default"] = float("nan")
    if optimum and t.slots_per_gpu == 2:
        row["cp_lo"], row["cp_hi"], row["cp_default"] = _optimum(loads, p, t, optimum)
    row["zero_share"] = float((loads == 0).mean())
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", help="comma-separated case names (default: all); see --list")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--layers", type=int, default=16, help="layers per case (default 16, one search chunk)")
    ap.add_argument("--repeat", type=int, default=1, help="default plans per case; its time is the median")
    ap.add_argument("--jobs", type=int, default=1, help="cases measured in parallel processes (default 1)")
    ap.add_argument("--optimum", type=int, default=0, help="CP-SAT bracket on the first N layers (2 slots/gpu)")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    table = cases(args.layers)
    names = select(ap, table, args.shapes, args.list)
    if names is None:
        return
    head = (
        f"{'case':34} {'eplb.py':>8} {'fast':>8} {'default':>8} {'high':>8} {'bound':>7} {'prof':>7} "
        f"{'gap%':>6} {'room%':>6} {'cp lo':>7} {'cp hi':>7} {'def@cp':>7} | {'def ms':>7}"
    )
    print(head)
    print("-" * len(head))
    jobs = [(n, args.layers, args.repeat, args.optimum) for n in names]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            rows = list(ex.map(measure, *zip(*jobs)))
    else:
        rows = (measure(*j) for j in jobs)
    out = {}
    for r in rows:
        r["gap"] = r["default"] / min(r["high"], r["default"]) - 1
        r["room"] = r["default"] / max(r["bound"], r["profile"]) - 1
        out[r["name"]] = r
        print(
            f"{r['name']:34} {r['deepseek']:8.4f} {r['fast']:8.4f} {r['default']:8.4f} {r['high']:8.4f} "
            f"{r['bound']:7.4f} {r['profile']:7.4f} {100 * r['gap']:6.2f} {100 * r['room']:6.2f} "
            f"{r['cp_lo']:7.4f} {r['cp_hi']:7.4f} {r['cp_default']:7.4f} | {r['default_s'] * 1e3:7.0f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

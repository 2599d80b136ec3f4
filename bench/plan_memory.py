"""Peak memory of real plans against ``eplb.limits.plan_bytes``, the estimate of it.

    python -m eplb_bench.plan_memory [--shapes NAME,...] [--workload zipf-1.0] [--json out.json]

For each shape, four kinds of ``eplb.rebalance`` at default effort: a fresh plan of loads
(seed 1); a re-plan of them with ``previous=`` a fast plan of other loads (seed 0); the fresh
plan with gpu 0 down; the re-plan with gpu 0 down. Each is measured as the peak of the
allocations traced by ``tracemalloc`` (numpy's arrays included) during the call, less what was
held before it; the estimate is ``plan_bytes`` of the topology ``rebalance`` plans (the live
gpus' when a gpu is down; ``replan=True`` with ``previous=``). "ratio" is estimate over
measured: at least 1 where the estimate is an upper bound. The loads of a re-plan are
unrelated to the previous placement's, so its repairs have the most to do. A survivor kind is
left out where the live gpus have fewer slots than there are experts.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from collections.abc import Callable

import eplb
from eplb.limits import plan_bytes, size_text
from eplb.survivors import live_topology
from eplb.workloads import make_loads

SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {  # name → (L, E, P, G, N, groups)
    "v3-prefill": (58, 256, 288, 32, 4, 8),
    "v3-decode-144": (58, 256, 288, 144, 18, 8),
    "v3-512": (58, 256, 512, 256, 32, 8),
    "kimi-64": (61, 384, 448, 64, 8, 1),
    "S=64 G=16": (8, 256, 1024, 16, 1, 1),
    "S=128 G=4": (8, 256, 512, 4, 1, 1),
    "S=128 G=16 N=4": (4, 256, 2048, 16, 4, 8),
    "S=512 G=2": (4, 256, 1024, 2, 1, 1),
    "S=512 G=4": (4, 1024, 2048, 4, 1, 1),
    "S=512 G=8": (2, 1024, 4096, 8, 1, 1),
    "S=8000 G=1": (1, 8000, 8000, 1, 1, 1),
    "E=P=2e4 G=1e3": (1, 20000, 20000, 1000, 1, 1),
    "E=P=2e4 G=1e4": (1, 20000, 20000, 10000, 1, 1),
}
KINDS = ("fresh", "re-plan", "survivor", "survivor re-plan")


def traced_peak(call: Callable[[], object]) -> tuple[int, float]:
    """Peak bytes traced during ``call()`` above what was traced before it, and its seconds."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        return tracemalloc.get_traced_memory()[1] - before, seconds
    finally:
        tracemalloc.stop()


def measure(name: str, workload: str) -> list[dict]:
    """One row per kind of ``name``: its estimate, measured peak and seconds."""
    t = eplb.Topology(*SHAPES[name])
    old = make_loads(workload, t, seed=0)
    loads = make_loads(workload, t, seed=1)
    previous = eplb.rebalance(old, t, effort="fast").placement
    live = t.num_gpus > 1 and (t.num_gpus - 1) * t.slots_per_gpu >= t.num_experts
    reduced = live_topology(t, [0]) if live else None
    calls = {
        "fresh": (t, False, lambda: eplb.rebalance(loads, t)),
        "re-plan": (t, True, lambda: eplb.rebalance(loads, t, previous=previous)),
        "survivor": (reduced, False, lambda: eplb.rebalance(loads, t, down_gpus=[0])),
        "survivor re-plan": (reduced, True, lambda: eplb.rebalance(loads, t, previous=previous, down_gpus=[0])),
    }
    rows = []
    for kind, (topo, replan, call) in calls.items():
        if topo is None:
            continue
        peak, seconds = traced_peak(call)
        est = plan_bytes(topo, replan=replan)
        rows.append(dict(shape=name, kind=kind, estimate=est, peak=peak, ratio=est / peak, seconds=seconds))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names (default: all)")
    ap.add_argument("--workload", default="zipf-1.0")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    print(f"workload {args.workload}; peak: tracemalloc during eplb.rebalance; ratio: estimate / peak")
    print(
        f"{'shape':16} {'L':>3} {'E':>6} {'P':>6} {'G':>6} {'S':>5} {'kind':17} {'estimate':>9} {'peak':>9} "
        f"{'ratio':>6} {'s':>6}"
    )
    rows = []
    for name in names:
        L, E, P, G, _, _ = SHAPES[name]
        for row in measure(name, args.workload):
            rows.append(row)
            print(
                f"{name:16} {L:>3} {E:>6} {P:>6} {G:>6} {P // G:>5} {row['kind']:17} {size_text(row['estimate']):>9} "
                f"{size_text(row['peak']):>9} {row['ratio']:>6.2f} {row['seconds']:>6.1f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Solve time and imbalance of every policy at the standard scales and workloads.

    python -m eplb_bench.solve_bench [--scales v3-prefill,v3-512] [--workloads lognormal-1.0]
                                     [--policies global,deepseek] [--repeat 5] [--json out.json]

Prints a Markdown table: median solve seconds per full-model plan (single process; pin to one
core with ``taskset -c 0`` for the figures in BENCHMARKS.md), mean and worst imbalance over
layers, and the mean lower bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import eplb
from eplb.workloads import SCALES, WORKLOADS, make_loads

DEFAULT_POLICIES = ("deepseek", "global", "hierarchical")


def measure(scale: str, workload: str, policy: str, repeat: int, seed: int = 0) -> dict:
    topo = SCALES[scale]
    loads = make_loads(workload, topo, seed)
    if policy == "hierarchical" and not topo.hierarchical_ok:
        return {"scale": scale, "workload": workload, "policy": policy, "skipped": "num_groups % num_nodes != 0"}
    times = []
    plan = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        plan = eplb.rebalance(loads, topo, policy)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return {
        "scale": scale,
        "workload": workload,
        "policy": policy,
        "median_seconds": statistics.median(times),
        "mean_imbalance": plan.mean_imbalance,
        "max_imbalance": plan.max_imbalance,
        "mean_imbalance_lb": float(plan.imbalance_lb.mean()),
    }


def table(rows: list[dict]) -> str:
    out = ["| scale | workload | policy | solve ms (median) | imbalance mean | imbalance worst | lower bound |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['scale']} | {r['workload']} | {r['policy']} | skipped: {r['skipped']} | | | |")
            continue
        out.append(
            f"| {r['scale']} | {r['workload']} | {r['policy']} | {r['median_seconds'] * 1e3:.2f} | "
            f"{r['mean_imbalance']:.4f} | {r['max_imbalance']:.4f} | {r['mean_imbalance_lb']:.4f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="v3-prefill,v3-decode-144,v3-512,v3-64,qwen3-64,kimi-64")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    rows = [
        measure(s, w, p, args.repeat)
        for s in args.scales.split(",")
        for w in args.workloads.split(",")
        for p in args.policies.split(",")
    ]
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

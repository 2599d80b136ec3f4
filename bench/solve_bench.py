"""Solve time and imbalance of every policy at the standard scales and workloads.

    python -m eplb_bench.solve_bench [--scales v3-prefill,v3-512] [--workloads lognormal-1.0]
        [--policies deepseek,global,hierarchical,global:high] [--repeat 5] [--json out.json]
        [--reference PATH/TO/eplb.py]

A policy may carry an effort, ``global:high``. For each scale × workload × policy it prints the
median over ``--repeat`` runs of the policy's own solve time (``Plan.solve_seconds``, without
the metrics ``rebalance`` adds), mean and worst imbalance over layers and the mean lower bound,
then a summary: per policy, the worst solve time per scale and how often it is worse than
``deepseek``. Pin to one core (``taskset -c 0``) for the figures in the README (scales: docs/scales.md).

``--reference`` times DeepSeek's own eplb.py (needs torch; the file is not part of eplb) on the
same inputs in the same run, for speed-up ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections import defaultdict

import numpy as np

import eplb
from eplb.workloads import SCALES, WORKLOADS, make_loads

DEFAULT_POLICIES = ("deepseek", "global", "hierarchical", "global:high")
DEFAULT_SCALES = "v3-prefill,v3-decode-144,v3-512,v3-64,qwen3-64,kimi-64"


def _split(spec: str) -> tuple[str, dict]:
    name, _, effort = spec.partition(":")
    return name, ({"effort": effort} if effort else {})


def measure(scale: str, workload: str, spec: str, repeat: int, seed: int = 0) -> dict:
    topo = SCALES[scale]
    loads = make_loads(workload, topo, seed)
    policy, options = _split(spec)
    row: dict = {"scale": scale, "workload": workload, "policy": spec}
    if policy == "hierarchical" and not topo.hierarchical_ok:
        return {**row, "skipped": "num_groups % num_nodes != 0"}
    times = []
    plan = None
    for _ in range(repeat):
        plan = eplb.rebalance(loads, topo, policy, **options)
        times.append(plan.solve_seconds)
    assert plan is not None
    return {
        **row,
        "median_seconds": statistics.median(times),
        "mean_imbalance": plan.mean_imbalance,
        "max_imbalance": plan.max_imbalance,
        "mean_imbalance_lb": float(plan.imbalance_lb.mean()),
    }


def measure_reference(path: str, scale: str, workload: str, repeat: int, seed: int = 0) -> dict:
    """Times eplb.py's ``rebalance_experts`` (torch) on the same loads."""
    import torch  # only for the reference run

    spec = importlib.util.spec_from_file_location("eplb_reference", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    topo = SCALES[scale]
    weight = torch.tensor(make_loads(workload, topo, seed))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        phy2log, _, _ = mod.rebalance_experts(weight, topo.num_slots, topo.num_groups, topo.num_nodes, topo.num_gpus)
        times.append(time.perf_counter() - t0)
    placement = eplb.Placement(phy2log.numpy(), topo)
    imb = eplb.imbalance(eplb.gpu_loads(make_loads(workload, topo, seed), placement))
    return {
        "scale": scale,
        "workload": workload,
        "policy": "eplb.py",
        "median_seconds": statistics.median(times),
        "mean_imbalance": float(imb.mean()),
        "max_imbalance": float(imb.max()),
        "mean_imbalance_lb": float(eplb.imbalance_lb(make_loads(workload, topo, seed), topo).mean()),
    }


def table(rows: list[dict]) -> str:
    out = [
        "| scale | workload | policy | solve ms (median) | imbalance mean | imbalance worst | lower bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['scale']} | {r['workload']} | {r['policy']} | skipped: {r['skipped']} | | | |")
            continue
        out.append(
            f"| {r['scale']} | {r['workload']} | {r['policy']} | {r['median_seconds'] * 1e3:.2f} | "
            f"{r['mean_imbalance']:.4f} | {r['max_imbalance']:.4f} | {r['mean_imbalance_lb']:.4f} |"
        )
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    ds = {
        (r["scale"], r["workload"]): r["mean_imbalance"]
        for r in rows
        if r["policy"] == "deepseek" and "skipped" not in r
    }
    by = defaultdict(list)
    for r in rows:
        if "skipped" not in r:
            by[(r["policy"], r["scale"])].append(r)
    out = [
        "| policy | scale | solve ms (median over workloads) | worst solve ms | mean imbalance | worse than deepseek |",
        "|---|---|---|---|---|---|",
    ]
    for (policy, scale), rs in by.items():
        worse = [r["workload"] for r in rs if r["mean_imbalance"] > ds.get((scale, r["workload"]), np.inf) + 1e-12]
        out.append(
            f"| {policy} | {scale} | {statistics.median(r['median_seconds'] for r in rs) * 1e3:.1f} | "
            f"{max(r['median_seconds'] for r in rs) * 1e3:.1f} | {np.mean([r['mean_imbalance'] for r in rs]):.4f} | "
            f"{', '.join(worse) if worse else 'none'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default=DEFAULT_SCALES)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reference", help="path to DeepSeek's eplb.py, timed on the same inputs (needs torch)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    rows = []
    for s in args.scales.split(","):
        for w in args.workloads.split(","):
            rows += [measure(s, w, p, args.repeat) for p in args.policies.split(",")]
            if args.reference:
                rows.append(measure_reference(args.reference, s, w, max(1, min(args.repeat, 3))))
    print(table(rows))
    print()
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Solve time and imbalance of every policy at the standard scales and workloads.

    python -m eplb_bench.solve_bench [--scales v3-prefill,v3-512] [--workloads lognormal-1.0]
        [--policies deepseek,global,hierarchical,global:high] [--repeat 5] [--json out.json]
        [--reference PATH/TO/eplb.py] [--baseline DIR] [--cpu]

A policy may carry an effort, ``global:high``. For each scale × workload × policy it prints the
median over ``--repeat`` runs of the policy's own solve time (``Plan.solve_seconds``, without
the metrics ``rebalance`` adds), mean and worst imbalance over layers and the mean lower bound,
then a summary: per policy, the worst solve time per scale and how often it is worse than
``deepseek``. Pin to one core (``taskset -c 0``) for the figures in the README (scales: docs/scales.md).

``--reference`` times DeepSeek's own eplb.py (needs torch; the file is not part of eplb) on the
same inputs in the same run, for speed-up ratios.

``--cpu`` times CPU seconds (``time.thread_time``) of the policy alone, the registered function and
the placement check that ``Plan.solve_seconds`` covers on the wall clock, every policy (and the
baseline's) call by call in turn: on a shared machine another process's load then shows less and
hits all alike. The table also gives each time over ``deepseek``'s in the same run (``--policies``
must include it).

``--baseline DIR`` times another copy of the ``eplb`` package (``DIR/eplb``, e.g. an older
commit: ``git archive REV eplb | tar -x -C DIR``) against this one, alternating the two plan by
plan within each repeat so that a shared machine's drift hits both alike; each row then also
gives the baseline's median, the ratio and whether the placements are identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
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


def load_baseline(directory: str):
    """``DIR/eplb`` imported as a package of its own name (``eplb_baseline``), beside ``eplb``."""
    spec = importlib.util.spec_from_file_location(
        "eplb_baseline", f"{directory}/eplb/__init__.py", submodule_search_locations=[f"{directory}/eplb"]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eplb_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def policy_cpu_seconds(mod, loads: np.ndarray, topo, policy: str, options: dict) -> float:
    """CPU seconds of ``mod``'s policy ``policy`` on ``loads`` (``[L, E]``): the registered
    function and the placement check, without the metrics ``rebalance`` adds."""
    spec = mod.get_policy(policy)
    opts, _ = spec.parse(options)
    start = time.thread_time()
    result = spec.fn(loads, topo, opts)
    mod.Placement(result.phy2log, topo)
    return time.thread_time() - start


def measure(scale: str, workload: str, spec: str, repeat: int, seed: int = 0, baseline=None) -> dict:
    topo = SCALES[scale]
    loads = make_loads(workload, topo, seed)
    policy, options = _split(spec)
    row: dict = {"scale": scale, "workload": workload, "policy": spec}
    if policy == "hierarchical" and not topo.hierarchical_ok:
        return {**row, "skipped": "num_groups % num_nodes != 0"}
    base_topo = None if baseline is None else _baseline_topology(baseline, topo)
    times, base_times = [], []
    plan = base_plan = None
    for i in range(repeat):
        # Alternate which goes first, so neither always runs on a warmer cache.
        if baseline is not None and i % 2 == 0:
            base_plan = baseline.rebalance(loads, base_topo, policy, **options)
            base_times.append(base_plan.solve_seconds)
        plan = eplb.rebalance(loads, topo, policy, **options)
        times.append(plan.solve_seconds)
        if baseline is not None and i % 2 == 1:
            base_plan = baseline.rebalance(loads, base_topo, policy, **options)
            base_times.append(base_plan.solve_seconds)
    assert plan is not None
    return _row(row, times, plan, base_times, base_plan)


def measure_cpu(scale: str, workload: str, specs: list[str], repeat: int, seed: int = 0, baseline=None) -> list[dict]:
    """``--cpu``: every policy of ``specs`` (and the baseline's) timed call by call in turn, the
    order rotating each repeat, so that a shared machine's load hits all alike; CPU seconds of
    the policy alone (``policy_cpu_seconds``). The plans are then made once for their figures."""
    topo = SCALES[scale]
    loads = make_loads(workload, topo, seed)
    base_topo = None if baseline is None else _baseline_topology(baseline, topo)
    runs = []  # (spec, module, topology)
    for spec in specs:
        if _split(spec)[0] == "hierarchical" and not topo.hierarchical_ok:
            continue
        runs.append((spec, eplb, topo))
        if baseline is not None:
            runs.append((spec, baseline, base_topo))
    times: dict = defaultdict(list)
    for i in range(repeat):
        for j in range(len(runs)):
            spec, mod, tp = runs[(i + j) % len(runs)]
            policy, options = _split(spec)
            times[(spec, mod is eplb)].append(policy_cpu_seconds(mod, loads, tp, policy, options))
    rows = []
    for spec in specs:
        policy, options = _split(spec)
        row: dict = {"scale": scale, "workload": workload, "policy": spec}
        if policy == "hierarchical" and not topo.hierarchical_ok:
            rows.append({**row, "skipped": "num_groups % num_nodes != 0"})
            continue
        plan = eplb.rebalance(loads, topo, policy, **options)
        base_plan = None if baseline is None else baseline.rebalance(loads, base_topo, policy, **options)
        rows.append(_row(row, times[(spec, True)], plan, times[(spec, False)], base_plan))
    return rows


def _baseline_topology(baseline, t):
    return baseline.Topology(t.num_layers, t.num_experts, t.num_slots, t.num_gpus, t.num_nodes, t.num_groups)


def _row(row: dict, times: list, plan, base_times: list, base_plan) -> dict:
    out = {
        **row,
        "median_seconds": statistics.median(times),
        "mean_imbalance": plan.mean_imbalance,
        "max_imbalance": plan.max_imbalance,
        "mean_imbalance_lb": float(plan.imbalance_lb.mean()),
    }
    if base_plan is not None:
        out["baseline_median_seconds"] = statistics.median(base_times)
        out["baseline_mean_imbalance"] = base_plan.mean_imbalance
        out["identical_to_baseline"] = bool(np.array_equal(plan.phy2log, base_plan.phy2log))
    return out


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


def baseline_table(rows: list[dict]) -> str:
    out = [
        "| scale | workload | policy | baseline ms (median) | this ms (median) | this / baseline | placements identical | imbalance mean (baseline → this) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "baseline_median_seconds" not in r:
            continue
        b, t = r["baseline_median_seconds"], r["median_seconds"]
        out.append(
            f"| {r['scale']} | {r['workload']} | {r['policy']} | {b * 1e3:.2f} | {t * 1e3:.2f} | {t / b:.2f} | "
            f"{'yes' if r['identical_to_baseline'] else 'no'} | {r['baseline_mean_imbalance']:.4f} → {r['mean_imbalance']:.4f} |"
        )
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    ds = {
        (r["scale"], r["workload"]): r["median_seconds"]
        for r in rows
        if r["policy"] == "deepseek" and "skipped" not in r
    }
    out = [
        "| scale | workload | policy | solve ms (median) | / deepseek | imbalance mean | imbalance worst | lower bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['scale']} | {r['workload']} | {r['policy']} | skipped: {r['skipped']} | | | | |")
            continue
        ref = ds.get((r["scale"], r["workload"]))
        ratio = f"{r['median_seconds'] / ref:.2f}" if ref else ""
        out.append(
            f"| {r['scale']} | {r['workload']} | {r['policy']} | {r['median_seconds'] * 1e3:.2f} | {ratio} | "
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
    ap.add_argument("--baseline", metavar="DIR", help="also time DIR/eplb (another copy of the package), alternating")
    ap.add_argument("--cpu", action="store_true", help="time CPU seconds of the policy alone (time.thread_time)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    baseline = load_baseline(args.baseline) if args.baseline else None
    rows = []
    for s in args.scales.split(","):
        for w in args.workloads.split(","):
            specs = args.policies.split(",")
            if args.cpu:
                rows += measure_cpu(s, w, specs, args.repeat, baseline=baseline)
            else:
                rows += [measure(s, w, p, args.repeat, baseline=baseline) for p in specs]
            if args.reference:
                rows.append(measure_reference(args.reference, s, w, max(1, min(args.repeat, 3))))
    print(table(rows))
    print()
    print(summary(rows))
    if baseline is not None:
        print()
        print(baseline_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

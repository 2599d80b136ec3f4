"""The default plan against ``effort="high"``, the first greedy plan and eplb.py, with the bound.

    python -m eplb_bench.default_bench [--cases NAME,...] [--repeat 3] [--workers 1] [--seed 0] [--no-high]
        [--json out.json] [--baseline DIR]

Rows are the cases of issue 13's target table (seeded workloads of ``eplb.workloads`` at the
standard scales of docs/scales.md) and synthetic loads shaped like large decode deployments:
128-256 experts at two slots per gpu, zipf 0.8-1.2, lognormal sigma 1-1.5, and mixtures where
four experts take 3-5 % of a layer each, and at full depth a Qwen3-235B-like model (94 layers,
128 experts) on 128 gpus with routing counts shaped as ``shapes_bench``'s. For every row: mean imbalance over layers of
``deepseek`` (eplb.py's algorithm), the first plan (``effort="fast"``), the default and
``effort="high"``, all with the ``global`` policy (``auto`` where the row says so), the lower
bound (``Plan.imbalance_lb``), at two slots per gpu also the profile bound
(``eplb.bounds.profile_bound``, "prof"), and each plan's median solve time over ``--repeat``
runs; "work" is the default's search work per layer in units (``Plan.search``), a
machine-independent proxy for its time.
The machine is usually shared: compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

import numpy as np

import eplb
from eplb.bounds import profile_bound
from eplb.planner.replicate import replica_cap

from .harness.cases import cases, select
from .harness.trees import TreePair


def measure(
    topology: eplb.Topology, loads: np.ndarray, policy: str, repeat: int, workers: int, high: bool = True
) -> dict:
    row: dict = {"high": float("nan"), "high_s": float("nan")}
    runs = [
        ("deepseek", "deepseek", {}),
        ("fast", policy, {"effort": "fast"}),
        ("default", policy, {"workers": workers}),
    ]
    if high:
        runs.append(("high", policy, {"effort": "high", "workers": workers}))
    for name, pol, opts in runs:
        secs, plan = [], None
        for _ in range(repeat):
            plan = eplb.rebalance(loads, topology, pol, **opts)
            secs.append(plan.solve_seconds)
        row[name] = plan.mean_imbalance
        row[f"{name}_s"] = statistics.median(secs)
        if name == "default":
            row["work"] = plan.search.work / topology.num_layers if plan.search is not None else 0.0
        if name == "default":
            row["bound"] = float(plan.imbalance_lb.mean())
            row["policy_used"] = plan.policy_used
            row["profile"] = _profile(loads, topology, plan)
    return row


def _profile(loads: np.ndarray, topology: eplb.Topology, plan: eplb.Plan) -> float:
    """Mean over layers of the best bound with the profile bound (two slots per gpu only,
    between the plan's bound and its busiest gpu), over mean gpu load."""
    t = topology
    mean = loads.sum(axis=1) / t.num_gpus
    lb = plan.imbalance_lb * mean
    if t.slots_per_gpu != 2:
        return float(plan.imbalance_lb.mean())
    cap = replica_cap(t.num_experts, t.num_slots, t.num_gpus)
    return float((np.maximum(lb, profile_bound(loads, t.num_gpus, cap, lb, plan.gpu_load.max(axis=1))) / mean).mean())


def serve(seed: int) -> None:
    """Plan on request: each line ``case effort`` on stdin → one JSON line (cpu and wall
    seconds of ``rebalance``, placement hash) on stdout; each case's loads are drawn once."""
    table, jobs = cases(seed), {}
    for line in sys.stdin:
        name, effort = line.rstrip("\n").rsplit(" ", 1)
        if name not in jobs:
            jobs[name] = table[name]()
        t, loads, policy = jobs[name]
        c0, t0 = time.process_time(), time.perf_counter()
        plan = eplb.rebalance(loads, t, policy, effort=effort)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        digest = hashlib.sha256(np.ascontiguousarray(plan.phy2log).tobytes()).hexdigest()[:12]
        print(json.dumps([cpu, wall, digest]), flush=True)


def against(baseline: str, names: list[str], repeat: int, seed: int) -> None:
    """The ``--baseline`` table: the default and first plans of this tree's ``eplb`` and of
    ``baseline``'s (``DIR/eplb``), in two processes asked in turn plan by plan (the order
    swapped every repeat), so that a shared machine's drift hits both alike."""
    print("| case | effort | baseline cpu ms | this cpu ms | this / baseline | identical |")
    print("|---|---|---|---|---|---|")
    with TreePair("eplb_bench.default_bench", baseline, ("--seed", str(seed))) as pair:
        for name in names:
            for effort in ("fast", "default"):
                got: dict[str, list] = {k: [] for k in pair.TREES}
                for k in pair.TREES:
                    pair.ask(k, f"{name} {effort}")  # warm-up: draws the loads, fills caches
                for i in range(repeat):
                    for k in pair.TREES if i % 2 == 0 else reversed(pair.TREES):
                        got[k].append(pair.ask(k, f"{name} {effort}"))
                b, t = (1e3 * statistics.median(x[0] for x in got[k]) for k in ("baseline", "this"))
                same = "yes" if got["baseline"][0][2] == got["this"][0][2] else "no"
                print(f"| {name} | {effort} | {b:.1f} | {t:.1f} | {t / b:.2f} | {same} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", help="comma-separated case names (default: all); see --list")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    ap.add_argument("--repeat", type=int, default=1, help="runs per plan; solve times are medians (default 1)")
    ap.add_argument("--workers", type=int, default=1, help="processes for the default and high plans (default 1)")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--seed", type=int, default=0, help="added to every case's seed (default 0: the documented rows)")
    ap.add_argument("--no-high", action="store_true", help="leave out effort='high' (the slowest column)")
    ap.add_argument(
        "--baseline",
        metavar="DIR",
        help="time the first and default plans of DIR/eplb (e.g. an older commit: git archive REV eplb | tar -x -C DIR) "
        "against this tree's, alternating plan by plan (--repeat times, default 5 here), instead of the table",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.seed)
        return
    table = cases(args.seed)
    names = select(ap, table, args.cases, args.list)
    if names is None:
        return
    if args.baseline:
        if not os.path.isdir(os.path.join(args.baseline, "eplb")):
            ap.error(f"--baseline {args.baseline}: no eplb package in it (expected {args.baseline}/eplb)")
        against(args.baseline, names, args.repeat if args.repeat > 1 else 5, args.seed)
        return
    head = (
        f"{'case':34} {'eplb.py':>8} {'fast':>8} {'default':>8} {'high':>8} {'bound':>7} {'prof':>7} | "
        f"{'fast ms':>8} {'def ms':>8} {'high ms':>8} {'work':>6}"
    )
    print(head)
    print("-" * len(head))
    rows = {}
    for name in names:
        t, loads, policy = table[name]()
        r = measure(t, loads, policy, args.repeat, args.workers, not args.no_high)
        rows[name] = r
        print(
            f"{name:34} {r['deepseek']:8.4f} {r['fast']:8.4f} {r['default']:8.4f} {r['high']:8.4f} {r['bound']:7.4f} "
            f"{r['profile']:7.4f} | {r['fast_s'] * 1e3:8.0f} {r['default_s'] * 1e3:8.0f} {r['high_s'] * 1e3:8.0f} "
            f"{r['work'] / 1e3:5.0f}k",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

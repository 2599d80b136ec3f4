"""How far past ``time_limit`` a plan returns, per planning path, idle or with the cores loaded.

    python -m eplb_bench.time_limit_bench [--scale v3-prefill] [--workload zipf-1.5]
        [--limits 0.05,0.3,1] [--cases global,auto,...] [--load 2] [--repeat 3]

For each case and limit: the wall-clock seconds of the ``rebalance`` call (worst and median of
``--repeat`` runs), how far the worst went past the limit, and whether the plan says the limit
cut it (``SearchStats.timed_out``). Cases: fresh plans with ``global``, ``hierarchical`` and
``auto`` at the default effort, ``global`` at ``effort="high"`` and with ``workers=2`` (its
pool started before the timing), and migration-aware re-plans (``auto`` from a plan of the
undrifted loads, to a snapshot drifted by σ 0.2), free and under a move budget of 5 % of the
slots. ``--load N`` starts N busy-loop processes on every core for the run (stopped at the end),
so the plans share the cores as on a loaded machine; pin the bench itself with ``taskset -c 1``
to share one core with them. The machine is usually shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import eplb
from eplb.workers import shutdown_pools
from eplb.workloads import SCALES, drift, make_loads

CASES = ("global", "hierarchical", "auto", "global-high", "workers2", "replan", "replan-budget")


def _run(case: str, loads: np.ndarray, snap: np.ndarray, topo: eplb.Topology, base: eplb.Placement, limit: float):
    budget = max(1, topo.num_layers * topo.num_slots // 20)
    calls = {
        "global": lambda: eplb.rebalance(loads, topo, "global", time_limit=limit),
        "hierarchical": lambda: eplb.rebalance(loads, topo, "hierarchical", time_limit=limit),
        "auto": lambda: eplb.rebalance(loads, topo, "auto", time_limit=limit),
        "global-high": lambda: eplb.rebalance(loads, topo, "global", effort="high", time_limit=limit),
        "workers2": lambda: eplb.rebalance(loads, topo, "global", workers=2, time_limit=limit),
        "replan": lambda: eplb.rebalance(snap, topo, "auto", previous=base, time_limit=limit),
        "replan-budget": lambda: eplb.rebalance(snap, topo, "auto", previous=base, max_moves=budget, time_limit=limit),
    }
    start = time.perf_counter()
    plan = calls[case]()
    return time.perf_counter() - start, plan


def _busy(n: int) -> list[subprocess.Popen]:
    # Every core, whatever this process is pinned to: the load is the machine's, not ours.
    everywhere = lambda: os.sched_setaffinity(0, range(os.cpu_count() or 1))  # noqa: E731
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code], preexec_fn=everywhere) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="v3-prefill", help="a standard scale (default v3-prefill)")
    ap.add_argument("--workload", default="zipf-1.5", help="a standard workload (default zipf-1.5)")
    ap.add_argument("--limits", default="0.05,0.3,1", help="comma-separated time limits in seconds")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases (default: {','.join(CASES)})")
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes running meanwhile (default 0)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case and limit (default 3)")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    limits = [float(x) for x in args.limits.split(",") if x]
    topo = SCALES[args.scale]
    loads = make_loads(args.workload, topo, seed=0)
    snap = drift(loads, 0.2, 1, seed=1)[0]
    base = eplb.rebalance(loads, topo, "auto").placement
    if "workers2" in cases:
        eplb.rebalance(loads, topo, "global", effort="fast", workers=2)  # the pool starts once, not per plan
    busy = _busy(args.load)
    try:
        print(f"{args.scale} {args.workload}, load {args.load} busy processes, {args.repeat} runs each")
        print(f"{'case':14s} {'limit':>6s} {'worst':>7s} {'median':>7s} {'over':>7s}  timed_out")
        for case in cases:
            for limit in limits:
                runs = [_run(case, loads, snap, topo, base, limit) for _ in range(args.repeat)]
                secs = [s for s, _ in runs]
                cut = sum(bool(p.search and p.search.timed_out) for _, p in runs)
                worst = max(secs)
                print(
                    f"{case:14s} {limit:6.2f} {worst:7.3f} {statistics.median(secs):7.3f} "
                    f"{worst - limit:+7.3f}  {cut}/{len(runs)}",
                    flush=True,
                )
    finally:
        for p in busy:
            p.kill()
            p.wait()
        shutdown_pools()
    return 0


if __name__ == "__main__":
    sys.exit(main())

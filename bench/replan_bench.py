"""Time of one migration-aware re-plan, by number of worker processes, with placement hashes.

    python -m eplb_bench.replan_bench [--cases v3-prefill,kimi-64,kimi-64-budget,...] [--workers 1,2]
                                      [--repeats 7] [--profile] [--baseline DIR]

Each case plans drift-0.2 snapshot 0 fresh (lognormal σ=1 base, as ``drift_bench``), then times
``eplb.rebalance(snapshot 1, previous=that plan)``: ``v3-prefill`` with ``hierarchical``,
``kimi-64`` with ``auto`` (global: one group), ``kimi-64-budget`` the same under
``max_moves`` = 5 % of all slots (the budget binds, so partial repairs run); the
``-contiguous`` cases re-plan the same snapshot from ``eplb.Placement.contiguous`` instead (the
first version a service publishes, about four times the fresh plan's busiest gpu). Runs of all worker
counts alternate, so a busy machine slows each alike; the table prints the median and the
fastest wall time of ``--repeats``, the median cpu time of this process (with one worker, the
whole re-plan's work, steadier than wall time on a shared machine; with more, what stays in
the parent) and a hash of the placement, which must be the same for every count.
``--profile`` adds, per case, the shares of a one-process re-plan spent in the fresh plan, in the
layers' candidates and in the serial rest (the pick across layers), and the speed-up they
give on 2, 4 and 16 processes by Amdahl's law (see ``amdahl``: the fresh plan's layers go in
fixed chunks of 16, so at most ``ceil(L / 16)`` processes share it).

``--baseline DIR`` times another tree's ``eplb`` (``DIR/eplb``, e.g. the commit before a change)
against this one instead: one process per tree (each with its own worker pools), re-plans of
the two alternating, and per case and worker count both medians, their ratio, the median cpu
time of each and whether the placements are identical.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import sys
import time

import numpy as np

import eplb
from eplb.workloads import SCALES, drift, make_loads

from .harness.trees import TreePair

# name: (scale, policy, move budget as a share of all slots, previous placement).
CASES = {
    "v3-prefill": ("v3-prefill", "hierarchical", None, "plan"),
    "kimi-64": ("kimi-64", "auto", None, "plan"),
    "kimi-64-budget": ("kimi-64", "auto", 0.05, "plan"),
    "v3-prefill-budget": ("v3-prefill", "hierarchical", 0.05, "plan"),
    "v3-prefill-contiguous": ("v3-prefill", "hierarchical", None, "contiguous"),
    "kimi-64-contiguous": ("kimi-64", "auto", None, "contiguous"),
}
# Layers per job of the fresh plan's pool (eplb.planner.anytime.CHUNK): its chunks are
# fixed, so the fresh plan runs in at most ceil(L / 16) processes; candidates split any way.
FRESH_CHUNK = 16


def setup(case: str) -> tuple:
    scale, policy, share, start = CASES[case]
    topo = SCALES[scale]
    seq = drift(make_loads("lognormal-1.0", topo), 0.2, 2)
    prev = eplb.rebalance(seq[0], topo, policy).placement if start == "plan" else eplb.Placement.contiguous(topo)
    budget = {} if share is None else {"max_moves": int(share * topo.num_slots * topo.num_layers)}
    return seq[1], topo, policy, prev, budget


def replan(args: tuple, workers: int) -> eplb.Plan:
    loads, topo, policy, prev, budget = args
    return eplb.rebalance(loads, topo, policy, previous=prev, workers=workers, **budget)


def digest(plan: eplb.Plan) -> str:
    return hashlib.sha256(np.ascontiguousarray(plan.placement.phy2log).tobytes()).hexdigest()[:12]


def shares(args: tuple) -> tuple[float, float, float]:
    """Shares of a one-process re-plan's time in the fresh plan's layer chunks, in the layers'
    candidates and in neither (the cross-layer pick and set-up), by cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    replan(args, 1)
    total = time.perf_counter() - t0
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    fresh, cands = (sum(v[3] for k, v in stats.items() if k[2] == name) / total for name in ("_plan_chunks", "_ways"))
    return fresh, cands, max(1.0 - fresh - cands, 0.0)


def amdahl(fresh: float, cands: float, serial: float, layers: int, k: int) -> float:
    """Speed-up on ``k`` processes, taking work per layer as even: the fresh plan's critical path
    is the ``ceil(chunks / k)`` chunks of 16 layers one process runs, the candidates' is
    ``ceil(L / k)`` layers; the serial part stays. Pool traffic is left out."""
    chunks = -(-layers // FRESH_CHUNK)
    path = min(1.0, -(-chunks // k) * FRESH_CHUNK / layers)
    return 1.0 / (serial + fresh * path + cands * -(-layers // k) / layers)


def serve() -> None:
    """Re-plan on request: each line ``case workers`` on stdin → one JSON line (wall and cpu
    seconds, placement hash) on stdout; the cases are set up once."""
    jobs: dict[str, tuple] = {}
    for line in sys.stdin:
        case, workers = line.split()
        if case not in jobs:
            jobs[case] = setup(case)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = replan(jobs[case], int(workers))
        print(json.dumps([time.perf_counter() - t0, time.process_time() - c0, digest(plan)]), flush=True)


def against(baseline: str, cases: list[str], counts: list[int], repeats: int) -> None:
    """The ``--baseline`` table: this tree's ``eplb`` and ``baseline``'s, alternating."""
    print("| case | workers | baseline ms | this ms | ratio | baseline cpu ms | this cpu ms | ratio | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    with TreePair("eplb_bench.replan_bench", baseline) as pair:
        for case in cases:
            got: dict[tuple[str, int], list] = {}
            for name in pair.TREES:
                for w in counts:
                    pair.ask(name, f"{case} {w}")  # warm-up: starts the pools
            for i in range(repeats):
                for name in pair.TREES if i % 2 == 0 else reversed(pair.TREES):
                    for w in counts:
                        got.setdefault((name, w), []).append(pair.ask(name, f"{case} {w}"))
            for w in counts:
                b, t = got[("baseline", w)], got[("this", w)]
                bw, tw = (np.median([x[0] for x in r]) * 1e3 for r in (b, t))
                bc, tc = (np.median([x[1] for x in r]) * 1e3 for r in (b, t))
                print(
                    f"| {case} | {w} | {bw:.0f} | {tw:.0f} | {bw / tw:.2f}x | {bc:.0f} | {tc:.0f} | {bc / tc:.2f}x | "
                    f"{'yes' if b[0][2] == t[0][2] else 'no'} |",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="v3-prefill,kimi-64,kimi-64-budget,v3-prefill-contiguous,kimi-64-contiguous")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="also measure the per-layer share (Amdahl)")
    ap.add_argument("--baseline", metavar="DIR", help="time DIR/eplb against this tree, alternating")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    if args.serve:
        serve()
        return 0
    if args.baseline:
        against(args.baseline, args.cases.split(","), counts, args.repeats)
        return 0
    print("| case | workers | median ms | fastest ms | parent cpu ms | moves | mean imbalance | placement hash |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        job = setup(case)
        plans = {w: replan(job, w) for w in counts}  # warm-up: starts the pools
        times: dict[int, list[float]] = {w: [] for w in counts}
        cpu: dict[int, list[float]] = {w: [] for w in counts}
        for _ in range(args.repeats):
            for w in counts:
                t0, c0 = time.perf_counter(), time.process_time()
                replan(job, w)
                times[w].append(time.perf_counter() - t0)
                cpu[w].append(time.process_time() - c0)
        for w in counts:
            p = plans[w]
            print(
                f"| {case} | {w} | {np.median(times[w]) * 1e3:.0f} | {min(times[w]) * 1e3:.0f} | "
                f"{np.median(cpu[w]) * 1e3:.0f} | "
                f"{p.total_moves} | {p.mean_imbalance:.4f} | {digest(p)} |"
            )
        if args.profile:
            fresh, cands, serial = shares(job)
            est = ", ".join(f"{k}: {amdahl(fresh, cands, serial, job[1].num_layers, k):.1f}x" for k in (2, 4, 16))
            print(
                f"|  | one process: fresh plan {fresh:.1%}, candidates {cands:.1%}, serial {serial:.1%} | estimate {est} | | | | | |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One migration-aware re-plan at the service's documented size limits (``eplb/limits.py``).

    /usr/bin/time -f %M python -m eplb_bench.replan_limits [--layers 128] [--slots 8192]
                                                        [--nodes 1] [--groups 1] [--policy auto]

Plans lognormal-0.5 loads (seed 0) fresh at ``effort="fast"``, then re-plans other loads
(seed 1) with ``previous=`` that plan, and prints both times and the moved slots. The default
topology is the largest the service takes: 128 layers x 8192 experts x 8192 slots (the 4 MiB
placement limit) on 4096 gpus. Peak memory is the process's: run it under ``/usr/bin/time``.
"""

from __future__ import annotations

import argparse
import time

import eplb
from eplb.limits import MAX_EXPERTS, MAX_GPUS
from eplb.workloads import make_loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=128)
    ap.add_argument("--slots", type=int, default=MAX_EXPERTS)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--policy", default="auto")
    args = ap.parse_args()
    topo = eplb.Topology(args.layers, MAX_EXPERTS, args.slots, MAX_GPUS, args.nodes, args.groups)
    t0 = time.perf_counter()
    prev = eplb.rebalance(make_loads("lognormal-0.5", topo, seed=0), topo, args.policy, effort="fast").placement
    t1 = time.perf_counter()
    loads = make_loads("lognormal-0.5", topo, seed=1)
    plan = eplb.rebalance(loads, topo, args.policy, previous=prev, effort="fast")
    t2 = time.perf_counter()
    print(f"{topo}: fresh {t1 - t0:.1f} s, re-plan {t2 - t1:.1f} s, {int(plan.moves.sum())} slots moved")


if __name__ == "__main__":
    main()

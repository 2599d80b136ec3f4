"""A hash of every placement the bench workloads give, to prove a change behaviour-preserving.

    python -m eplb_bench.placement_hashes [--layers 20] [--scales a,b] [--out FILE]

For each standard scale (``eplb.workloads.SCALES``, cut to ``--layers`` layers so that two
16-layer search chunks still run) and each workload (``WORKLOADS``): fresh plans with
``global`` at ``effort="fast"`` and the default, ``hierarchical`` (where groups fit nodes),
``auto`` and ``deepseek``; then migration-aware re-plans from the default ``auto`` plan to a
drifted snapshot (drift σ 0.2), free and under a move budget of 5 % of the slots. One line per
case, ``case  hash  mean-imbalance  moves``, then the hash of all of them. Run it before and
after a refactor and ``diff`` the outputs: any changed line names the case that changed.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import eplb
from eplb.workloads import SCALES, WORKLOADS, drift, make_loads


def _digest(plan: eplb.Plan) -> str:
    return hashlib.sha256(np.ascontiguousarray(plan.phy2log, dtype=np.int32).tobytes()).hexdigest()[:16]


def cases(layers: int, scales: list[str]) -> list[tuple[str, eplb.Plan]]:
    """Every (case name, plan) of the module doc, in a fixed order."""
    out: list[tuple[str, eplb.Plan]] = []
    for scale in scales:
        full = SCALES[scale]
        topo = full.with_layers(min(layers, full.num_layers))
        for workload in WORKLOADS:
            loads = make_loads(workload, topo, seed=0)
            runs: list[tuple[str, str, dict]] = [
                ("global-fast", "global", {"effort": "fast"}),
                ("global", "global", {}),
                ("auto", "auto", {}),
                ("deepseek", "deepseek", {}),
            ]
            if topo.num_nodes > 1 and topo.num_groups > 1 and topo.hierarchical_ok:
                runs.insert(2, ("hierarchical", "hierarchical", {}))
            for name, policy, opts in runs:
                out.append((f"{scale}/{workload}/{name}", eplb.rebalance(loads, topo, policy, **opts)))
            base = eplb.rebalance(loads, topo, "auto")
            snap = drift(loads, 0.2, 2, seed=1)[1]
            out.append((f"{scale}/{workload}/replan", eplb.rebalance(snap, topo, "auto", previous=base.placement)))
            budget = max(1, topo.num_layers * topo.num_slots // 20)
            out.append(
                (
                    f"{scale}/{workload}/replan-budget",
                    eplb.rebalance(snap, topo, "auto", previous=base.placement, max_moves=budget),
                )
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=20, help="layers per scale (default 20)")
    ap.add_argument("--scales", default=",".join(SCALES), help="comma-separated scales (default: all)")
    ap.add_argument("--out", help="also write the lines to this file")
    args = ap.parse_args(argv)
    scales = [s for s in args.scales.split(",") if s]
    unknown = [s for s in scales if s not in SCALES]
    if unknown:
        ap.error(f"--scales: unknown {unknown}; known: {', '.join(SCALES)}")
    total = hashlib.sha256()
    lines = []
    for name, plan in cases(args.layers, scales):
        line = f"{name:48s} {_digest(plan)} {plan.mean_imbalance:.6f} {plan.total_moves}"
        lines.append(line)
        total.update(line.encode())
        print(line, flush=True)
    print(f"all {len(lines)} cases: {total.hexdigest()[:16]}")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

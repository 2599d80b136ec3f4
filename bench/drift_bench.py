"""Re-planning under drifting and shifting loads: moves and imbalance per re-plan.

    python -m eplb_bench.drift_bench [--scales v3-prefill,kimi-64,v3-decode-144] [--steps 20]
                                     [--tolerance 0.01] [--layer-tolerance 0.05] [--policy auto]
                                     [--max-moves-share 0.05] [--json FILE]

For each scale and sequence (drift 0.05, drift 0.2, shift; lognormal σ=1 base) it re-plans at
every snapshot three ways: fresh (no `previous`), migration-aware (`previous=` the last plan,
`auto` policy) and deepseek (eplb.py from scratch), and prints mean moves per re-plan as a
share of all slots, the mean and worst imbalance gap to the fresh plan (mean imbalance over
layers, per re-plan), the worst single layer's gap, the gap right after the shift, and the share
of gpus above the target ((1 + tolerance) x fresh's busiest gpu of their layer) before each
re-plan: each of those needs a slot of its own rewritten or one of its experts to gain a replica.
"floor, counts kept" is a lower bound on the moves of any re-plan that keeps the replica counts
(``kept_count_floor``); "re-plan ms" the median time of a migration-aware re-plan.
``--max-moves-share`` gives every migration-aware re-plan a move budget (``max_moves``) of that
share of all slots: the table then shows how close to fresh that budget keeps the balance.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import eplb
from eplb.workloads import SCALES, drift, make_loads, shift

from .harness.floors import kept_count_floor


def run(
    scale: str,
    name: str,
    steps: int,
    tolerance: float,
    layer_tolerance: float,
    policy: str = "auto",
    max_moves_share: float | None = None,
) -> dict:
    topo = SCALES[scale]
    base = make_loads("lognormal-1.0", topo)
    seq = drift(base, float(name.split("-")[1]), steps) if name.startswith("drift") else shift(base, steps)
    total = topo.num_slots * topo.num_layers
    budget = {} if max_moves_share is None else {"max_moves": int(max_moves_share * total)}
    prev = eplb.rebalance(seq[0], topo, policy).placement
    prev_fresh, prev_ds = prev, eplb.rebalance(seq[0], topo, "deepseek").placement
    # Plans that keep groups whole on nodes: the floor holds node by node, or two groups move.
    hier = eplb.rebalance(seq[0], topo, policy).policy_used == "hierarchical"
    by_node = (topo.num_nodes, 2.0 * topo.num_experts / topo.num_groups) if hier else (1, np.inf)
    rows = []
    for t in range(1, steps):
        fresh = eplb.rebalance(seq[t], topo, policy)
        t0 = time.perf_counter()
        aware = eplb.rebalance(
            seq[t], topo, policy, previous=prev, tolerance=tolerance, layer_tolerance=layer_tolerance, **budget
        )
        seconds = time.perf_counter() - t0
        kept = eplb.gpu_loads(seq[t], prev)
        items = (seq[t] / prev.logcnt)[np.arange(topo.num_layers)[:, None], prev.phy2log]
        items = items.reshape(topo.num_layers, topo.num_gpus, topo.slots_per_gpu)
        ds = eplb.rebalance(seq[t], topo, "deepseek", previous=prev_ds)
        rows.append(
            {
                "fresh_moves": float(eplb.moves(prev_fresh, fresh.placement).sum() / total),
                "aware_moves": aware.total_moves / total,
                "deepseek_moves": ds.total_moves / total,
                "fresh_imbalance": fresh.mean_imbalance,
                "aware_imbalance": aware.mean_imbalance,
                "deepseek_imbalance": ds.mean_imbalance,
                "gap": aware.mean_imbalance / fresh.mean_imbalance - 1.0,
                # Gpus above (1 + tolerance) x fresh's busiest before re-planning: each needs one
                # of its slots rewritten, or one of its experts to gain a replica elsewhere.
                "over": float((kept > (1 + tolerance) * fresh.gpu_load.max(axis=1)[:, None]).mean()),
                "floor": kept_count_floor(items, fresh.gpu_load.max(axis=1), fresh.imbalance, tolerance, *by_node)
                / total,
                "seconds": seconds,
                "layer_gap": float((aware.imbalance / fresh.imbalance).max() - 1.0),
            }
        )
        prev, prev_fresh, prev_ds = aware.placement, fresh.placement, ds.placement
    gaps = np.array([r["gap"] for r in rows])
    out = {
        "scale": scale,
        "policy": policy,
        "sequence": name,
        "steps": steps,
        "tolerance": tolerance,
        "layer_tolerance": layer_tolerance,
        "max_moves_share": max_moves_share,
    }
    for key in (
        "fresh_moves",
        "aware_moves",
        "deepseek_moves",
        "fresh_imbalance",
        "aware_imbalance",
        "deepseek_imbalance",
        "over",
        "floor",
    ):
        out[key] = float(np.mean([r[key] for r in rows]))
    out["replan_seconds"] = float(np.median([r["seconds"] for r in rows]))
    out["gap_mean"], out["gap_max"] = float(gaps.mean()), float(gaps.max())
    out["layer_gap_max"] = max(r["layer_gap"] for r in rows)
    if name == "shift":
        out["gap_after_shift"] = float(gaps[steps // 2 - 1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="v3-prefill,kimi-64,v3-decode-144")
    ap.add_argument("--sequences", default="drift-0.05,drift-0.2,shift")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--layer-tolerance", type=float, default=0.05)
    ap.add_argument("--policy", default="auto", help="the policy of every plan but deepseek's (default auto)")
    ap.add_argument("--max-moves-share", type=float, help="move budget per re-plan, a share of all slots (0.05 = 5 %%)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [
        run(s, q, args.steps, args.tolerance, args.layer_tolerance, args.policy, args.max_moves_share)
        for s in args.scales.split(",")
        for q in args.sequences.split(",")
    ]
    print(
        "| scale | sequence | moves/re-plan: fresh | migration-aware | deepseek | imbalance: fresh | migration-aware "
        "| deepseek | gap to fresh mean / worst | worst layer gap | gap after shift | gpus over target before "
        "| floor, counts kept | re-plan ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        after = f"{r['gap_after_shift'] * 100:.2f} %" if "gap_after_shift" in r else ""
        print(
            f"| {r['scale']} | {r['sequence']} | {r['fresh_moves'] * 100:.1f} % | {r['aware_moves'] * 100:.1f} % | "
            f"{r['deepseek_moves'] * 100:.1f} % | {r['fresh_imbalance']:.4f} | {r['aware_imbalance']:.4f} | "
            f"{r['deepseek_imbalance']:.4f} | {r['gap_mean'] * 100:.2f} % / {r['gap_max'] * 100:.2f} % | "
            f"{r['layer_gap_max'] * 100:.2f} % | {after} | {r['over'] * 100:.1f} % | {r['floor'] * 100:.1f} % | "
            f"{r['replan_seconds'] * 1e3:.0f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

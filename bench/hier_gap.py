"""How far ``hierarchical`` is from the best placement that keeps expert groups whole on nodes.

    python -m eplb_bench.hier_gap [--scale v3-prefill] [--workloads zipf-1.0,...] [--json FILE]

The best grouping-constrained placement is not known exactly at full scale, so each layer is
compared with both sides of it:

- a lower bound: over every way to give each node ``num_groups / num_nodes`` groups, the
  largest over nodes of a bound for that node alone, minimised over the ways. The node bound
  is the larger of ``eplb.lower_bound`` (its load over its gpus, and water-filling of its
  slots with at most one replica per gpu) and a pigeonhole bound on its ``k`` busiest
  experts: whatever their replica counts ``c_i`` (at most one per gpu, together at most the
  node's spare slots plus ``k``), some gpu holds ``m = ceil(sum c_i / gpus)`` of them, so
  carries at least the ``m`` smallest of their replica loads, and any subset ``T`` of them with
  ``sum_T c_i > (|T| - 1) gpus`` has all its replicas' loads on one gpu;
- the best placement found: ``hierarchical`` with ``effort="high"`` (no time limit).

It prints, per workload, the mean imbalance of the default ``hierarchical``, of the best found
and of the bound, and the default's mean gap to each.
"""

from __future__ import annotations

import argparse
import json
from itertools import combinations

import numpy as np

import eplb
from eplb.bounds import pigeonhole_bound
from eplb.workloads import SCALES, WORKLOADS, make_loads


def _partitions(items: tuple[int, ...], size: int) -> list[list[tuple[int, ...]]]:
    """Every split of ``items`` into blocks of ``size`` (block order ignored)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for others in combinations(rest, size - 1):
        block = (first, *others)
        left = tuple(i for i in rest if i not in others)
        out += [[block, *tail] for tail in _partitions(left, size)]
    return out


def node_pigeonhole_bound(loads: np.ndarray, gpus: int, slots: int, k: int = 4) -> np.ndarray:
    """``loads`` ``[L, n]`` of one node's experts → ``[L]`` lower bound on its busiest gpu: the
    least over the replica counts of its ``k`` busiest experts that the node's spare slots
    allow of ``eplb.bounds.pigeonhole_bound``."""
    L, n = loads.shape
    k = min(k, n)
    top = -np.sort(-loads, axis=1)[:, :k]  # [L, k]
    grid = np.stack(np.meshgrid(*[np.arange(1, gpus + 1)] * k, indexing="ij"), axis=-1).reshape(-1, k)
    grid = grid[(grid - 1).sum(axis=1) <= slots - n]  # the other experts need one slot each
    return pigeonhole_bound(top, grid, gpus).min(axis=1)


def grouped_bound(loads: np.ndarray, topo: eplb.Topology) -> np.ndarray:
    """``[L, E]`` → ``[L]`` lower bound on the busiest gpu of any placement keeping groups whole
    on nodes (equal groups per node, at most one replica of an expert per gpu)."""
    L, K = topo.num_layers, topo.num_groups // topo.num_nodes
    gs = topo.experts_per_group
    node = eplb.Topology(L, K * gs, topo.slots_per_node, topo.gpus_per_node)
    splits = _partitions(tuple(range(topo.num_groups)), K)
    # Bound of every possible node content (a K-subset of groups), then min over splits.
    cache: dict[tuple[int, ...], np.ndarray] = {}
    best = np.full(L, np.inf)
    for split in splits:
        worst = np.zeros(L)
        for block in split:
            if block not in cache:
                experts = np.concatenate([np.arange(g * gs, (g + 1) * gs) for g in block])
                node_loads = loads[:, experts]
                cache[block] = np.max(
                    [
                        eplb.lower_bound(node_loads, node),
                        # Each k gives a valid bound, and a larger k is not always tighter.
                        *(
                            node_pigeonhole_bound(node_loads, topo.gpus_per_node, topo.slots_per_node, k)
                            for k in (2, 3, 4)
                        ),
                    ],
                    axis=0,
                )
            worst = np.maximum(worst, cache[block])
        best = np.minimum(best, worst)
    return best


def run(scale: str, workload: str) -> dict:
    topo = SCALES[scale]
    loads = make_loads(workload, topo)
    mean = loads.sum(axis=1) / topo.num_gpus
    default = eplb.rebalance(loads, topo, "hierarchical")
    high = eplb.rebalance(loads, topo, "hierarchical", effort="high", time_limit=None)
    bound = grouped_bound(loads, topo) / mean
    best = np.minimum(default.imbalance, high.imbalance)
    return {
        "scale": scale,
        "workload": workload,
        "hierarchical": default.mean_imbalance,
        "best_found": float(best.mean()),
        "bound": float(bound.mean()),
        "gap_to_best": float((default.imbalance / best - 1).mean()),
        "gap_to_bound": float((default.imbalance / bound - 1).mean()),
        "best_gap_to_bound": float((best / bound - 1).mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="v3-prefill")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    topo = SCALES[args.scale]
    if topo.num_nodes < 2 or not topo.hierarchical_ok:
        ap.error(f"scale {args.scale} has no groups to keep on nodes")
    rows = [run(args.scale, w) for w in args.workloads.split(",")]
    print(
        "| scale | workload | hierarchical | best found (effort high) | grouped lower bound | gap to best found | gap to bound | best found to bound |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['scale']} | {r['workload']} | {r['hierarchical']:.4f} | {r['best_found']:.4f} | {r['bound']:.4f} | "
            f"{r['gap_to_best'] * 100:.2f} % | {r['gap_to_bound'] * 100:.2f} % | {r['best_gap_to_bound'] * 100:.2f} % |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

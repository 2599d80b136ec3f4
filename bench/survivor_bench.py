"""Survivor plans: gpus down, against a fresh plan of the survivors and the engines' fault rules.

    python -m eplb_bench.survivor_bench [--scales v3-prefill,v3-decode-144,qwen3-64]
                                        [--workloads lognormal-1.0] [--down 1,2,node]
                                        [--repeats 3] [--spread] [--json FILE]

Per scale, workload and number of gpus down (``node``: a node's worth, the gpus of node 1;
otherwise the first gpus of node 1): the previous placement is the default ``auto`` plan of
the full topology; then, all on the same loads,

- ``fresh``: ``eplb.rebalance(loads, topo, down_gpus=down)``, the live gpus' own plan;
- ``eplb`` and ``eplb-fast``: ``eplb.rebalance(loads, topo, previous=prev, down_gpus=down)``
  at the default effort and ``effort="fast"`` (their times are medians of ``--repeats``);
- ``vllm-ft``: vLLM's fault-tolerance rule as its pull request describes it (vllm#46370,
  ``elastic_ep/ft_eplb_redistribute.py``), re-typed here: the dead ranks' slots are gone, each
  expert left without a replica is reloaded into the slot of a redundant replica of another
  expert, the live gpus taken round-robin; not load-balanced;
- ``sglang-elastic``: SGLang's ``elasticity_aware`` rule: DeepSeek's algorithm (the
  ``deepseek`` policy, eplb.py bit for bit) re-run over the survivors, ignoring where the
  weights already are.

Moves are slots rewritten on live gpus against the previous placement; the floors are the
experts that lost their last replica (no rule can rewrite fewer) and the counts floor: the
replicas the fresh survivor plan's counts add over what the live gpus kept (a placement with
those counts rewrites at least that many). Imbalance is the mean over layers of max / mean
gpu load over the live gpus. Times: the median cpu time of ``--repeats`` plans (one thread:
one core's time), the wall time in ``--json``. ``e128-g128x2`` is 128 experts on 128 gpus of two slots (16
nodes), the low-redundancy decode shape of ``default_bench``. ``--spread`` adds the cost of ``spread_nodes=True`` (each hot
expert's replicas over nodes) on the full topology (cpu seconds of the whole plan).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import eplb
from eplb.layout import replica_counts
from eplb.workloads import SCALES, make_loads

# The standard scales (docs/scales.md), and 128 experts on 128 gpus of two slots (the
# low-redundancy decode shape of default_bench), 16 nodes.
EXTRA = {"e128-g128x2": eplb.Topology(58, 128, 256, 128, 16, 1)}
DEFAULT_SCALES = ("v3-prefill", "v3-decode-144", "qwen3-64", "e128-g128x2")


def down_set(topo: eplb.Topology, what: str) -> list[int]:
    """``"node"``: node 1's gpus (node 0 with one node); a count: that many of its first gpus."""
    gpn = topo.gpus_per_node
    first = gpn if topo.num_nodes > 1 else 0
    k = min(gpn, topo.num_gpus - 1) if what == "node" else int(what)
    return list(range(first, first + k))


def vllm_ft(prev: eplb.Placement, down: list[int]) -> np.ndarray:
    """vLLM's fault rule, re-typed from its description → ``phy2log`` ``[L, P]`` (-1 on ``down``).

    Per layer: the down gpus' slots empty; each expert without a live replica, in id order,
    is reloaded into a slot of an expert that still has two or more replicas, taking the live
    gpus in turn (round-robin) and the first such slot of the gpu."""
    t = prev.topology
    S = t.slots_per_gpu
    phy = prev.phy2log.astype(np.int64).copy()
    for g in down:
        phy[:, g * S : (g + 1) * S] = -1
    live = [g for g in range(t.num_gpus) if g not in set(down)]
    for layer in range(t.num_layers):
        row = phy[layer]
        cnt = np.bincount(row[row >= 0], minlength=t.num_experts)
        turn = 0
        for e in np.flatnonzero(cnt == 0):
            for k in range(len(live)):
                g = live[(turn + k) % len(live)]
                slots = [p for p in range(g * S, (g + 1) * S) if cnt[row[p]] >= 2]
                if slots:
                    cnt[row[slots[0]]] -= 1
                    row[slots[0]] = e
                    cnt[e] += 1
                    turn = (turn + k + 1) % len(live)
                    break
    return phy


def _median_time(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and cpu seconds of ``repeats`` calls of ``fn`` (one process, one thread:
    the cpu time is one core's, steadier than wall time on a shared machine), and its result."""
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return float(np.median(wall)), float(np.median(cpu)), out


def case(scale: str, workload: str, what: str, repeats: int, spread: bool) -> dict:
    topo = SCALES[scale] if scale in SCALES else EXTRA[scale]
    loads = make_loads(workload, topo, seed=0)
    down = down_set(topo, what)
    row: dict = {"scale": scale, "workload": workload, "down": what, "gpus_down": down}
    prev = eplb.rebalance(loads, topo).placement
    try:
        fresh = eplb.rebalance(loads, topo, down_gpus=down)
    except ValueError as exc:
        row["error"] = str(exc)
        return row
    live_prev = prev.phy2log.reshape(topo.num_layers, topo.num_gpus, -1)
    live_prev = np.delete(live_prev, down, axis=1).reshape(topo.num_layers, -1)
    kept = replica_counts(live_prev, topo.num_experts)
    row["floor_lost"] = int((kept == 0).sum())
    row["floor_counts"] = int(np.maximum(fresh.logcnt - kept, 0).sum())
    row["fresh_imbalance"] = fresh.mean_imbalance
    row["fresh_moves"] = int(eplb.moves(prev, fresh.placement).sum())
    for name, effort in (("eplb", "default"), ("eplb-fast", "fast")):
        seconds, cpu, plan = _median_time(
            lambda e=effort: eplb.rebalance(loads, topo, previous=prev, down_gpus=down, effort=e), repeats
        )
        assert (plan.logcnt >= 1).all()
        row[f"{name}_seconds"] = seconds
        row[f"{name}_cpu_seconds"] = cpu
        row[f"{name}_imbalance"] = plan.mean_imbalance
        row[f"{name}_moves"] = plan.total_moves
        row[f"{name}_policy"] = plan.policy_used
        row[f"{name}_single_homed"] = int(plan.single_homed.sum())
    vllm = eplb.Placement(vllm_ft(prev, down), topo)
    row["vllm_imbalance"] = float(eplb.imbalance(eplb.gpu_loads(loads, vllm)).mean())
    row["vllm_moves"] = int(eplb.moves(prev, vllm).sum())
    sgl = eplb.rebalance(loads, topo, "deepseek", previous=prev, down_gpus=down)
    row["sglang_imbalance"] = sgl.mean_imbalance
    row["sglang_moves"] = sgl.total_moves
    row["live_slots"] = (topo.num_gpus - len(down)) * topo.slots_per_gpu * topo.num_layers
    if spread:
        base = eplb.rebalance(loads, topo)
        _, seconds, wide = _median_time(lambda: eplb.rebalance(loads, topo, spread_nodes=True), 1)
        row["spread"] = {
            "imbalance": [base.mean_imbalance, wide.mean_imbalance],
            "single_node": [int(base.single_node.sum()), int(wide.single_node.sum())]
            if base.single_node is not None
            else None,
            "seconds": seconds,
        }
    return row


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'scale':<14}{'down':>5} | {'fresh':>7}{'eplb':>7}{'fast':>7}{'vLLM':>7}{'SGLang':>7} | "
        f"{'lost':>6}{'counts':>7}{'eplb':>7}{'fast':>7}{'vLLM':>7}{'SGLang':>8}{'fresh':>8} | {'fast ms':>8}{'dflt ms':>8}"
    )
    print(
        "mean imbalance over live gpus | moves (slots rewritten on live gpus): floors, rules | "
        "plan cpu time (median), wall time in --json"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['scale']:<14}{r['down']:>5} | infeasible: {r['error']}")
            continue
        print(
            f"{r['scale']:<14}{r['down']:>5} | {r['fresh_imbalance']:7.4f}{r['eplb_imbalance']:7.4f}"
            f"{r['eplb-fast_imbalance']:7.4f}{r['vllm_imbalance']:7.4f}{r['sglang_imbalance']:7.4f} | "
            f"{r['floor_lost']:6d}{r['floor_counts']:7d}{r['eplb_moves']:7d}{r['eplb-fast_moves']:7d}"
            f"{r['vllm_moves']:7d}{r['sglang_moves']:8d}{r['fresh_moves']:8d} | "
            f"{r['eplb-fast_cpu_seconds'] * 1e3:8.0f}{r['eplb_cpu_seconds'] * 1e3:8.0f}"
        )
    spread = [r for r in rows if "spread" in r]
    if spread:
        print("\nspread_nodes=True on the full topology: mean imbalance, experts on one node (sum over layers)")
        for r in spread:
            s = r["spread"]
            print(
                f"{r['scale']:<14} {s['imbalance'][0]:.4f} -> {s['imbalance'][1]:.4f}   "
                f"{s['single_node'][0] if s['single_node'] else '-'} -> {s['single_node'][1] if s['single_node'] else '-'}"
                f"   ({s['seconds']:.2f} s)"
            )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default=",".join(DEFAULT_SCALES))
    ap.add_argument("--workloads", default="lognormal-1.0")
    ap.add_argument("--down", default="1,2,node")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spread", action="store_true")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for scale in args.scales.split(","):
        for workload in args.workloads.split(","):
            for i, what in enumerate(args.down.split(",")):
                rows.append(case(scale, workload, what, args.repeats, args.spread and i == 0))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: one line per case
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()

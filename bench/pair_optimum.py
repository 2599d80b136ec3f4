"""The best busiest gpu any replica counts allow at two slots per gpu, proven by CP-SAT.

    python -m eplb_bench.pair_optimum [--cases NAME,...] [--layers 0] [--steps 7] [--time-limit 20]

With two replicas per gpu, counts ``c`` reach a busiest gpu of at most ``T`` (replicas sorted
and paired i-th heaviest with i-th lightest; two replicas of one expert meeting is ignored,
which only relaxes it) iff for every ``y`` in ``[T/2, T]`` the replicas of at least ``y`` and
those of at least ``T - y`` number at most ``2 * gpus`` together (a replica of at least ``y``
needs a partner below ``T - y``). Those conditions are linear in one boolean per (expert,
count), so CP-SAT decides a ``T`` exactly; bisection between the mean gpu and the default
plan's busiest gpu brackets the optimum of each layer: ``lo`` is proven impossible, ``hi``
reached (by counts whose pairing is reported). Rows of ``eplb_bench.default_bench`` at two
slots per gpu; under zipf every layer has the same sorted loads, so layer 0 speaks for all.
Needs ortools (the ``ilp`` extra).
"""

from __future__ import annotations

import argparse

import eplb
from eplb.planner.replicate import replica_cap

from .harness.cases import cases
from .harness.optimum import bracket


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cases", help="comma-separated default_bench case names (default: the 256e/192gpu rows)")
    ap.add_argument("--layers", default="0", help="comma-separated layer indices (default 0)")
    ap.add_argument("--steps", type=int, default=7, help="bisection steps (default 7)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per target (default 20)")
    args = ap.parse_args(argv)
    table = cases()
    names = args.cases.split(",") if args.cases else [n for n in table if n.startswith("256e/192gpu/2spg")]
    print(f"{'case':34} {'layer':>5} {'default':>8} {'lo':>8} {'hi':>8}")
    for name in names:
        t, loads, policy = table[name]()
        if t.slots_per_gpu != 2:
            raise SystemExit(f"{name}: not two slots per gpu")
        plan = eplb.rebalance(loads, t, policy)
        for layer in map(int, args.layers.split(",")):
            row = loads[layer] / (loads[layer].sum() / t.num_gpus)  # in mean gpus
            default = float(plan.gpu_load[layer].max() / (loads[layer].sum() / t.num_gpus))
            cap = replica_cap(t.num_experts, t.num_slots, t.num_gpus)
            lo, hi = bracket(row, t.num_gpus, cap, 1.0, default, args.steps, args.time_limit)
            print(f"{name:34} {layer:5d} {default:8.4f} {lo:8.4f} {hi:8.4f}", flush=True)


if __name__ == "__main__":
    main()

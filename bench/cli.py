"""The ``eplb`` command: ``eplb place`` (more subcommands arrive with the tools and the service)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

import eplb
from eplb.workloads import SCALES, WORKLOADS, make_loads


def _place(args: argparse.Namespace) -> int:
    topo = SCALES[args.scale]
    loads = make_loads(args.workload, topo, args.seed)
    base = eplb.Placement.contiguous(topo)
    before = eplb.imbalance(eplb.gpu_loads(loads, base))
    plan = eplb.rebalance(loads, topo, args.policy)
    print(f"scale {args.scale}: {topo}")
    print(f"workload {args.workload} (seed {args.seed}), policy {plan.policy} -> {plan.policy_used}")
    for note in plan.notes:
        print(f"note: {note}")
    print(f"imbalance before (contiguous): mean {before.mean():.4f}  worst {before.max():.4f}")
    print(f"imbalance after:               mean {plan.mean_imbalance:.4f}  worst {plan.max_imbalance:.4f}")
    print(f"lower bound:                   mean {plan.imbalance_lb.mean():.4f}")
    print(f"replicas per expert: max {int(plan.logcnt.max())}, experts replicated per layer (mean) "
          f"{float((plan.logcnt > 1).sum(axis=1).mean()):.1f}")
    print(f"solve time: {plan.solve_seconds * 1e3:.1f} ms")
    if args.out:
        np.save(args.out, plan.phy2log)
        print(f"wrote phy2log {list(plan.phy2log.shape)} to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eplb", description="Expert-parallel load balancer for MoE inference.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("place", help="plan a placement for a built-in synthetic workload")
    p.add_argument("--scale", default="v3-prefill", choices=sorted(SCALES))
    p.add_argument("--workload", default="lognormal-1.0", choices=WORKLOADS)
    p.add_argument("--policy", default="auto", choices=eplb.policies())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write phy2log as .npy")
    p.set_defaults(fn=_place)
    s = sub.add_parser("serve", help="run the balancer service (eplb serve --help)", add_help=False)
    s.set_defaults(fn=None)
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        # Imported here so `eplb place` works without the service extra installed.
        from eplb_service.cli import main as serve_main

        return serve_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

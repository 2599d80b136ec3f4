"""How far the fast policies are from the CP-SAT optimum on small single-layer instances.

    python -m eplb_bench.ilp_gap [--seeds 3] [--time-limit 10] [--workers 8]
                                 [--policies deepseek,global,global:high,hierarchical] [--json out.json]
    python -m eplb_bench.ilp_gap --proofs --time-limit 60

The suite: every topology in ``TOPOLOGIES`` (8-16 experts, 4-8 gpus, 2-5 slots per gpu, two
nodes and four groups so ``hierarchical`` is valid) x ``WORKLOADS`` x seeds, one layer each.
The gap of a policy is its busiest gpu over the ILP's busiest gpu, minus one; where the ILP
did not prove optimality within the time limit the ILP's value is only an upper bound on the
optimum, so the gap is a lower estimate (the table says how many were proved). Needs OR-Tools
(``pip install 'eplb[ilp]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import eplb
from eplb.workloads import make_loads

# (experts, gpus, slots per gpu); nodes = 2 and groups = 4 throughout.
TOPOLOGIES: tuple[tuple[int, int, int], ...] = ((8, 4, 3), (8, 8, 2), (12, 4, 4), (12, 6, 3), (16, 4, 5), (16, 8, 3))
WORKLOADS: tuple[str, ...] = ("zipf-1.0", "zipf-1.5", "lognormal-0.5", "lognormal-1.0")
DEFAULT_POLICIES = ("deepseek", "global", "hierarchical")


def instance_rows(
    experts: int,
    gpus: int,
    per_gpu: int,
    workload: str,
    seed: int,
    policies: list[str],
    time_limit: float,
    workers: int,
) -> list[dict]:
    topo = eplb.Topology(1, experts, gpus * per_gpu, gpus, 2, 4)
    loads = make_loads(workload, topo, seed)
    ilp = eplb.rebalance(loads, topo, "ilp", time_limit=time_limit, workers=workers)
    best = float(ilp.gpu_load.max())
    base = {"experts": experts, "gpus": gpus, "slots": gpus * per_gpu, "workload": workload, "seed": seed}
    rows = [
        {
            **base,
            "policy": "ilp",
            "max_load": best,
            "gap": 0.0,
            "status": ilp.solver_status[0],
            "bound_gap": best / float(ilp.solver_bound[0]) - 1,
            "lb_gap": best / float(eplb.lower_bound(loads, topo)[0]) - 1,
            "seconds": ilp.solve_seconds,
        }
    ]
    for policy in policies:
        name, _, effort = policy.partition(":")  # "global:high" runs global with effort="high"
        if name == "hierarchical" and not topo.hierarchical_ok:
            continue
        plan = eplb.rebalance(loads, topo, name, **({"effort": effort} if effort else {}))
        value = float(plan.gpu_load.max())
        rows.append(
            {
                **base,
                "policy": policy,
                "max_load": value,
                "gap": value / best - 1,
                "status": ilp.solver_status[0],
                "seconds": plan.solve_seconds,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| policy | instances | mean gap to ILP | worst gap | mean gap where ILP proved | ILP proved optimal | median solve s | max solve s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = list(dict.fromkeys(r["policy"] for r in rows))
    for name in names:
        mine = [r for r in rows if r["policy"] == name]
        gaps = [r["gap"] for r in mine]
        secs = [r["seconds"] for r in mine]
        proved = [r["gap"] for r in mine if r["status"] == "OPTIMAL"]
        on_proved = f"{100 * statistics.fmean(proved):.3f} %" if proved else "n/a"
        out.append(
            f"| {name} | {len(mine)} | {100 * statistics.fmean(gaps):.3f} % | {100 * max(gaps):.3f} % | "
            f"{on_proved} | {len(proved)}/{len(mine)} | {statistics.median(secs):.4f} | {max(secs):.4f} |"
        )
    ilp = [r for r in rows if r["policy"] == "ilp"]
    open_ = [r["bound_gap"] for r in ilp if r["status"] != "OPTIMAL"]
    if open_:
        out.append("")
        out.append(
            f"ILP not proved on {len(open_)} instances: its value is within {100 * max(open_):.3f} % "
            f"(mean {100 * statistics.fmean(open_):.3f} %) of its proven bound there."
        )
    return "\n".join(out)


def by_topology(rows: list[dict]) -> str:
    out = [
        "| experts | gpus | slots | ILP proved | " + " | ".join(f"{p} mean gap" for p in DEFAULT_POLICIES) + " |",
        "|---|---|---|---|" + "---|" * len(DEFAULT_POLICIES),
    ]
    for e, g, s in TOPOLOGIES:
        mine = [r for r in rows if (r["experts"], r["gpus"], r["slots"]) == (e, g, g * s)]
        if not mine:
            continue
        ilp = [r for r in mine if r["policy"] == "ilp"]
        cells = []
        for p in DEFAULT_POLICIES:
            gaps = [r["gap"] for r in mine if r["policy"] == p]
            cells.append(f"{100 * statistics.fmean(gaps):.3f} %" if gaps else "n/a")
        proved = sum(r["status"] == "OPTIMAL" for r in ilp)
        out.append(f"| {e} | {g} | {g * s} | {proved}/{len(ilp)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def proof_cases() -> list[tuple[str, np.ndarray, eplb.Topology]]:
    """The instances the ILP must prove (the first four) and one it cannot yet (the last)."""
    t8, t16 = eplb.Topology(1, 8, 16, 8), eplb.Topology(1, 16, 20, 4)
    return [
        ("known answer, 8 / 8 / 16", np.array([[600.0, 560, 120, 120, 20, 10, 10, 10]]), t8),
        (
            "16 / 4 / 20, round(lognormal(0, 1) * 10), default_rng(0)",
            np.round(np.random.default_rng(0).lognormal(0, 1, (1, 16)) * 10),
            t16,
        ),
        ("8 / 8 / 16, lognormal-1.0 seed 0", make_loads("lognormal-1.0", t8, 0), t8),
        ("8 / 8 / 16, zipf-1.0 seed 0", make_loads("zipf-1.0", t8, 0), t8),
        ("16 / 4 / 20, zipf-1.0 seed 0 (float loads)", make_loads("zipf-1.0", t16, 0), t16),
    ]


def proofs(time_limit: float, workers: int) -> str:
    out = [
        "| instance | status | solver s | ILP max / mean | bound / mean | global max / mean |",
        "|---|---|---|---|---|---|",
    ]
    for name, loads, topo in proof_cases():
        plan = eplb.rebalance(loads, topo, "ilp", time_limit=time_limit, workers=workers)
        mean = loads.sum() / topo.num_gpus
        greedy = eplb.rebalance(loads, topo, "global").gpu_load.max()
        out.append(
            f"| {name} | {plan.solver_status[0]} | {plan.solver.seconds[0]:.1f} | "
            f"{plan.gpu_load.max() / mean:.5f} | {plan.solver_bound[0] / mean:.5f} | {greedy / mean:.5f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds per (topology, workload)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per instance")
    ap.add_argument(
        "--workers", type=int, default=8, help="CP-SAT search workers (8 proves more than 2 even on 2 cores)"
    )
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument(
        "--proofs", action="store_true", help="instead: time to prove the reference instances (use --time-limit 60)"
    )
    args = ap.parse_args(argv)
    if args.proofs:
        print(proofs(args.time_limit, args.workers))
        return 0
    policies = args.policies.split(",")
    rows: list[dict] = []
    for e, g, s in TOPOLOGIES:
        for w in WORKLOADS:
            for seed in range(args.seeds):
                rows += instance_rows(e, g, s, w, seed, policies, args.time_limit, args.workers)
    print(table(rows))
    print()
    print(by_topology(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

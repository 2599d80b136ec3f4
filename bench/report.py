"""``eplb-bench``: imbalance and solve-time report over policies, scales and workloads."""

from __future__ import annotations

import argparse

from . import solve_bench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eplb-bench", description="eplb imbalance report")
    ap.add_argument("--quick", action="store_true", help="one scale, three workloads, one run each")
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        forwarded = ["--scales", "v3-prefill", "--workloads", "zipf-1.0,lognormal-1.0,group-limited", "--repeat", "1"]
    else:
        forwarded = []
    if args.json:
        forwarded += ["--json", args.json]
    return solve_bench.main(forwarded)

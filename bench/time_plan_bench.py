"""Planning time with a kernel model against the token plan, at the standard scales (one core).

    python -m eplb_bench.time_plan_bench [--runs 3]

For each scale and batch size: the median over ``--runs`` of the token plan's seconds
(``eplb.rebalance``) and the plan for time's (``kernel_curve=`` the shipped H100 model of the
scale's expert shape, ``top_k=8``), the layers the time plan changed, and its predicted MoE ms
against the token plan's (``eplb.timing.predicted_layer_us``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import eplb
from eplb import timing
from eplb.workloads import SCALES, make_loads

CASES = (
    ("v3-prefill", "deepseek-v3@h100", (256, 4096)),
    ("v3-decode-144", "deepseek-v3@h100", (16,)),
    ("qwen3-64", "qwen3-235b-a22b@h100", (16, 256)),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workload", default="lognormal-1.0")
    args = ap.parse_args(argv)
    for scale, model, sizes in CASES:
        topo = SCALES[scale]
        loads = make_loads(args.workload, topo, seed=0)
        for b in sizes:
            tok, tim = [], []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                token = eplb.rebalance(loads, topo)
                t1 = time.perf_counter()
                plan = eplb.rebalance(loads, topo, kernel_curve=model, tokens_per_gpu=b, top_k=8)
                tim.append(time.perf_counter() - t1)
                tok.append(t1 - t0)
            before = timing.predicted_layer_us(token.placement, loads, model, b, 8).sum() / 1000.0
            changed = int((plan.phy2log != token.phy2log).any(axis=1).sum())
            print(
                f"{scale:14s} b={b:5d}  token plan {np.median(tok):.2f} s, for time {np.median(tim):.2f} s; "
                f"{changed} of {topo.num_layers} layers changed; predicted {before:.3f} -> {plan.predicted_ms[b]:.3f} ms "
                f"({plan.predicted_ms[b] / before - 1:+.1%})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-step realized imbalance against a published check (uniform routing).

    python -m eplb_bench.simulate_bench [--steps 400] [--seed 0] [--json FILE]

The check: uniform routing over 384 experts, top-6; EP64 with 448 slots, 4 tokens per
request, the busiest gpu carries about 17 % more than the mean at 8 requests per gpu, 6 % at
60 and 3 % at 256; EP8 with 416 slots at 8 requests per gpu about 10 %.

Interpretation that reproduces it: "4 tokens per request" are 4 tokens verified per request
per decode step (MTP / speculative decoding), each routed independently, so a step routes
``b = 4 * requests_per_gpu`` tokens per gpu; the placement is balanced (every gpu's expected
load is equal, ``eplb.rebalance(..., "global")`` on uniform loads) and the figure is the mean
over steps of max / mean gpu load, minus 1.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import eplb
from eplb.simulate import simulate_steps

TOKENS_PER_REQUEST = 4
TOPK = 6
# (experts, slots, gpus, requests per gpu, published excess of the busiest gpu over the mean)
PUBLISHED = (
    (384, 448, 64, 8, 0.17),
    (384, 448, 64, 60, 0.06),
    (384, 448, 64, 256, 0.03),
    (384, 416, 8, 8, 0.10),
)


def run(steps: int, seed: int = 0, tokens_per_request: int = TOKENS_PER_REQUEST) -> list[dict]:
    rows = []
    for experts, slots, gpus, requests, published in PUBLISHED:
        topo = eplb.Topology(1, experts, slots, gpus)
        uniform = np.ones(experts)
        placement = eplb.rebalance(uniform[None], topo, "global").placement
        b = tokens_per_request * requests
        t0 = time.perf_counter()
        st = simulate_steps(uniform, placement, b, TOPK, steps, seed=seed)
        rows.append(
            {
                "experts": experts,
                "slots": slots,
                "gpus": gpus,
                "requests_per_gpu": requests,
                "tokens_per_gpu": b,
                "published_excess": published,
                "excess_mean": st.mean - 1.0,
                "excess_p99": st.p99 - 1.0,
                "expected_ratio": st.expected_ratio,
                "steps": steps,
                "seconds": time.perf_counter() - t0,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| EP (gpus) | slots | requests/gpu | b tokens/gpu | steps | published | realized mean | realized p99 | sim s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['gpus']} | {r['slots']} | {r['requests_per_gpu']} | {r['tokens_per_gpu']} | {r['steps']} | "
            f"~{r['published_excess']:.0%} | {r['excess_mean']:.1%} | {r['excess_p99']:.1%} | {r['seconds']:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="sampled decode steps per row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokens-per-request",
        type=int,
        default=TOKENS_PER_REQUEST,
        help="tokens each request routes per step (4: the check's)",
    )
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    rows = run(args.steps, args.seed, args.tokens_per_request)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

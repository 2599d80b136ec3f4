"""MoE time per step of DeepSeek's eplb.py, eplb's default and eplb planned for time.

For each model shape, EP size and slot count, and each placement: routing is sampled token by
token (top-8, seeded, steps the planner never saw; ``eplb.timing.sample_slot_counts``) at each
tokens-per-gpu batch size, and each layer's time is the slowest gpu's. ``--kernels model`` scores
it with the kernel model (``eplb.kernel``, shipped H100 models); ``--kernels gpu`` runs every
gpu's slot set as real grouped GEMMs on this machine's GPU (``eplb_tools.calibrate.Timer``) and
takes the measured maximum.

Placements: ``deepseek`` (eplb.py's algorithm, ``policy="deepseek"``), ``default``
(``policy="auto"``), ``time@b`` (auto with ``kernel_curve=`` and ``tokens_per_gpu=b``, planned for
the batch size it is judged at) and ``time@mix`` (planned for the decode mix 4-256, equal weights).

    python -m eplb_bench.moe_time_bench                  # kernel model, every grid point
    python -m eplb_bench.moe_time_bench --kernels gpu    # real kernels (needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources

import numpy as np

import eplb
from eplb import kernel
from eplb.timing import sample_slot_counts
from eplb.workloads import WORKLOADS, make_loads

from .harness.shapes import SHAPES as TRACE_SHAPES
from .harness.shapes import make_shape

SHAPES = {"qwen3-30b-a3b": 48, "qwen3-235b-a22b": 94}  # MoE layers
CONFIGS = {"EP16 P=E": (16, 128), "EP32 P=E": (32, 128), "EP16 P=160": (16, 160), "EP32 P=192": (32, 192)}
BATCHES = (4, 16, 64, 256, 1024)
MIX = (4, 16, 64, 256)
TOP_K = 8


def gpu_max(loads: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L]`` the busiest gpu's tokens per layer."""
    return np.take_along_axis(loads, phy2log, axis=1).reshape(len(loads), num_gpus, -1).sum(axis=2).max(axis=1)


def tie_plan(loads: np.ndarray, topo: eplb.Topology, ours: eplb.Plan, ref: eplb.Plan, slack: float) -> eplb.Placement:
    """Per layer, ``ref``'s slots where its busiest gpu is within ``slack`` of ``ours``', else ours."""
    a, b = ours.placement.phy2log, ref.placement.phy2log
    take = gpu_max(loads, b, topo.num_gpus) <= gpu_max(loads, a, topo.num_gpus) * (1 + slack) + 1e-9
    return eplb.Placement(np.where(take[:, None], b, a), topo)


def single_expert_curve(name: str) -> kernel.Curve:
    """The shipped model ``name``'s one-slot samples as a plain ``Curve`` (tokens → microseconds
    of one expert alone, made non-decreasing): issue 34's simulation scored a gpu as the sum of
    such curves over its slots, which pays every expert's launches and under-used tiles again."""
    d = json.loads(resources.files("eplb.kernels").joinpath(f"{name}.json").read_text())
    one = sorted((n[0], u) for n, u in d["samples"]["train"] if len(n) == 1 and n[0] > 0)
    t = np.array([x[0] for x in one], dtype=np.float64)
    return kernel.Curve(t, np.maximum.accumulate(np.array([x[1] for x in one])))


def placements(
    loads: np.ndarray,
    topo: eplb.Topology,
    model: kernel.KernelModel,
    batches: tuple[int, ...],
    ties: bool = False,
    curve: kernel.Curve | None = None,
) -> dict:
    out = {"deepseek": eplb.rebalance(loads, topo, "deepseek"), "default": eplb.rebalance(loads, topo)}
    if ties:
        for slack in (0.0, 0.01):
            out[f"tie{slack:g}"] = tie_plan(loads, topo, out["default"], out["deepseek"], slack)
    for b in batches:
        out[f"time@{b}"] = eplb.rebalance(loads, topo, kernel_curve=model, tokens_per_gpu=b, top_k=TOP_K)
        if curve is not None:
            out[f"curve@{b}"] = eplb.rebalance(loads, topo, kernel_curve=curve, tokens_per_gpu=b, top_k=TOP_K)
    out["time@mix"] = eplb.rebalance(loads, topo, kernel_curve=model, tokens_per_gpu=list(MIX), top_k=TOP_K)
    return out


def layer_sets(plan: eplb.Plan | eplb.Placement, loads: np.ndarray, b: int, steps: int, seed: int) -> np.ndarray:
    """``[L, steps, G, S]`` tokens of each gpu's slots in sampled steps."""
    placement = plan if isinstance(plan, eplb.Placement) else plan.placement
    topo = placement.topology
    out = []
    for layer in range(topo.num_layers):
        c = sample_slot_counts(loads[layer], placement, b, TOP_K, steps, layer=layer, seed=seed + layer)
        out.append(c.reshape(steps, topo.num_gpus, topo.slots_per_gpu))
    return np.array(out)


def load_workload(name: str, topo: eplb.Topology, seed: int) -> np.ndarray:
    """``[L, E]`` loads: an ``eplb.workloads`` name, or a routing-count shape (``harness.shapes``:
    window counts with ties, zeros, dead and hot experts, as real traces have)."""
    if name in TRACE_SHAPES:
        return make_shape(TRACE_SHAPES[name], topo.num_layers, topo.num_experts, seed).astype(np.float64)
    return make_loads(name, topo, seed=seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", choices=("model", "gpu"), default="model")
    ap.add_argument("--gpu-name", default="h100", help="shipped model to plan with (and score with, --kernels model)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument(
        "--workload",
        default="lognormal-1.0",
        help=f"eplb.workloads name ({', '.join(WORKLOADS)}) or a routing-count shape shaped like real traces "
        f"(shapes_bench's: {'; '.join(TRACE_SHAPES)})",
    )
    ap.add_argument("--layers", type=int, default=8, help="layers planned and judged")
    ap.add_argument("--steps", type=int, default=8, help="held-out sampled steps per layer and batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ties",
        action="store_true",
        help="also judge tie0 / tie0.01: per layer, eplb.py's slots where its busiest gpu's tokens are within "
        "0 / 1 %% of the default's",
    )
    ap.add_argument(
        "--curve-plans",
        action="store_true",
        help="also judge curve@b: planned for time with the sum of one-expert curves (the shipped model's "
        "one-slot samples), as issue 34's simulation scored gpus",
    )
    ap.add_argument(
        "--score",
        choices=("model", "curve"),
        default="model",
        help="with --kernels model: score with the fitted model, or with the sum of one-expert curves",
    )
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    rows = []
    timers: dict = {}
    for shape in args.shapes.split(","):
        model = kernel.load(f"{shape}@{args.gpu_name}")
        curve = single_expert_curve(f"{shape}@{args.gpu_name}")
        judge: kernel.CostModel = curve if args.score == "curve" else model
        if args.kernels == "gpu":
            from eplb_tools.calibrate import SHAPES as HI
            from eplb_tools.calibrate import Shape, Timer

            timers[shape] = (Timer(Shape(*HI[shape]), replays=5), {})
        for cname in args.configs.split(","):
            G, P = CONFIGS[cname]
            topo = eplb.Topology(args.layers, 128, P, G, 1, 1)
            loads = load_workload(args.workload, topo, args.seed)
            t0 = time.perf_counter()
            plans = placements(loads, topo, model, batches, ties=args.ties, curve=curve if args.curve_plans else None)
            plan_s = time.perf_counter() - t0
            for b in batches:
                named = {
                    name: layer_sets(plan, loads, b, args.steps, seed=1000 + args.seed)
                    for name, plan in plans.items()
                    if not (name[:5] in ("time@", "curve") and name not in (f"time@{b}", "time@mix", f"curve@{b}"))
                    and not (name == "time@mix" and b not in MIX)
                }
                res = {}
                if args.kernels == "model":
                    for name, sets in named.items():
                        res[name] = float(judge.gpu_us(sets).max(axis=2).mean(axis=1).sum() / 1000.0)
                else:
                    # The placements' sets timed in turn, set by set, so a drift of the GPU's clock
                    # during the run weighs on every placement alike; a set two placements share is
                    # timed once.
                    timer, cache = timers[shape]
                    flat = {n: [tuple(x) for x in s.reshape(-1, s.shape[-1]).tolist()] for n, s in named.items()}
                    for i in range(len(next(iter(flat.values())))):
                        for n in flat:
                            key = flat[n][i]
                            if key not in cache:
                                cache[key] = timer.time(np.array(key))
                    for n, sets in named.items():
                        us = np.array([cache[k] for k in flat[n]]).reshape(sets.shape[:3]).max(axis=2)
                        res[n] = float(us.mean(axis=1).sum() / 1000.0)  # ms per step over the layers
                row = {"shape": shape, "config": cname, "tokens_per_gpu": b, "ms": res, "plan_s": round(plan_s, 2)}
                rows.append(row)
                tp = res[f"time@{b}"]
                line = (
                    f"{shape:16s} {cname:11s} b={b:5d}  eplb.py {res['deepseek']:.3f}  default {res['default']:.3f}"
                    f"  time {tp:.3f} ({(tp / res['default'] - 1):+.1%} vs default, {(tp / res['deepseek'] - 1):+.1%} vs eplb.py)"
                    f"  default vs eplb.py {(res['default'] / res['deepseek'] - 1):+.1%}"
                )
                if f"curve@{b}" in res:
                    c = res[f"curve@{b}"]
                    line += f"  curve {c:.3f} ({(c / res['default'] - 1):+.1%} vs default)"
                for n in ("tie0", "tie0.01"):
                    if n in res:
                        line += f"  {n} {res[n]:.3f} ({(res[n] / res['deepseek'] - 1):+.1%} vs eplb.py)"
                if "time@mix" in res:
                    line += f"  mix {res['time@mix']:.3f} ({(res['time@mix'] / res['default'] - 1):+.1%})"
                print(line, flush=True)
                if args.json:  # after every row: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
            mix = mix_summary([r for r in rows if r["shape"] == shape and r["config"] == cname])
            if mix:
                print(mix, flush=True)
    return 0


def mix_summary(rows: list[dict]) -> str | None:
    """One line over the decode mix (sizes 4-256, equal weights) of one shape and config: the mix
    plan and the best placement of each size alone (``time@b``, each judged at its own size: no
    single placement can beat that sum) against the default, as sums of the sizes' ms and as the
    mean of the sizes' relative changes; None unless every size of the mix was measured."""
    at = {r["tokens_per_gpu"]: r["ms"] for r in rows}
    if not all(b in at and "time@mix" in at[b] for b in MIX):
        return None
    default = sum(at[b]["default"] for b in MIX)
    mix = sum(at[b]["time@mix"] for b in MIX)
    best = sum(min(at[b]["default"], at[b][f"time@{b}"], at[b]["deepseek"]) for b in MIX)
    rel_mix = float(np.mean([at[b]["time@mix"] / at[b]["default"] - 1 for b in MIX]))
    rel_best = float(
        np.mean([min(at[b]["default"], at[b][f"time@{b}"], at[b]["deepseek"]) / at[b]["default"] - 1 for b in MIX])
    )
    worst = max(at[b]["time@mix"] / at[b]["default"] - 1 for b in MIX)
    r0 = rows[0]
    return (
        f"{r0['shape']:16s} {r0['config']:11s} mix {'/'.join(map(str, MIX))}: default {default:.3f} ms, "
        f"mix plan {mix:.3f} ({mix / default - 1:+.1%}; mean of sizes {rel_mix:+.1%}; worst size {worst:+.1%}), "
        f"best of each size alone {best:.3f} ({best / default - 1:+.1%}; mean of sizes {rel_best:+.1%})"
    )


if __name__ == "__main__":
    sys.exit(main())

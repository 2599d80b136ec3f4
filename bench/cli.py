"""The ``eplb`` command: ``eplb place`` (trace file or synthetic workload → placement file)
and ``eplb serve`` (the balancer service)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import eplb
from eplb.topology import Topology
from eplb.transfer import transfer_plan
from eplb.workloads import SCALES, WORKLOADS, make_loads

from . import io as eio

_TOPO_ARGS = ("layers", "experts", "slots", "gpus", "nodes", "groups")


def _topology(args: argparse.Namespace, layers: int | None, experts: int | None) -> Topology:
    """Topology from ``--scale`` / ``--topology`` / explicit flags (later ones win), with
    layers and experts defaulting to the trace's."""
    base: dict[str, int] = {}
    if args.scale:
        t = SCALES[args.scale]
        base = {n: getattr(t, f"num_{n}") for n in _TOPO_ARGS}
    if args.topology:
        t = eio.read_topology(args.topology)
        base = {n: getattr(t, f"num_{n}") for n in _TOPO_ARGS}
    base.setdefault("nodes", 1)
    base.setdefault("groups", 1)
    for name, value in (("layers", layers), ("experts", experts)):
        if value is not None and name not in base:
            base[name] = value
    for name in _TOPO_ARGS:
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    missing = [f"--{n}" for n in _TOPO_ARGS if n not in base]
    if missing:
        raise ValueError(f"topology incomplete: give {', '.join(missing)} (or --topology CONFIG / --scale NAME)")
    topo = Topology(*(base[n] for n in _TOPO_ARGS))
    if layers is not None and (topo.num_layers, topo.num_experts) != (layers, experts):
        raise ValueError(
            f"the trace has {layers} layers x {experts} experts but the topology says "
            f"{topo.num_layers} x {topo.num_experts}; fix --layers/--experts or the config"
        )
    return topo


def _place(args: argparse.Namespace) -> int:
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window must be a number of steps >= 1, got {args.window}")
    if args.trace:
        phy2log = eio.read_phy2log(args.recorded_under) if args.recorded_under else None
        trace = eio.read_trace(args.trace, args.trace_format, phy2log)
        topo = _topology(args, trace.num_layers, trace.num_experts)
        loads = trace.window(last=args.window, half_life=args.half_life)
        if args.window:
            source = f"trace {args.trace}: last {args.window} of {trace.num_steps} steps"
        elif args.half_life:
            source = f"trace {args.trace}: {trace.num_steps} steps, decay half-life {args.half_life} steps"
        else:
            source = f"trace {args.trace}: all {trace.num_steps} steps"
    else:
        if args.scale is None and args.topology is None and args.slots is None:
            args.scale = "v3-prefill"
        topo = _topology(args, None, None)
        loads = make_loads(args.synthetic, topo, args.seed)
        source = f"synthetic {args.synthetic} (seed {args.seed})"
    bounds = {
        k: v
        for k, v in (
            ("tolerance", args.tolerance),
            ("layer_tolerance", args.layer_tolerance),
            ("max_moves", args.max_moves),
            ("max_layer_moves", args.max_layer_moves),
        )
        if v is not None
    }
    if bounds and not args.previous:
        raise ValueError(
            "--tolerance, --layer-tolerance, --max-moves and --max-layer-moves bound a re-plan from the placement "
            "in service: give --previous PLACEMENT"
        )
    if args.expert_bytes is not None and not args.previous:
        raise ValueError("--expert-bytes sizes the copies from --previous PLACEMENT: give it too")
    previous = None
    if args.previous:
        prev = eio.read_phy2log(args.previous)
        if prev.shape != (topo.num_layers, topo.num_slots):
            raise ValueError(
                f"{args.previous}: the placement is {list(prev.shape)} (layers x slots) but the topology "
                f"needs [{topo.num_layers}, {topo.num_slots}]"
            )
        previous = eplb.Placement(prev, topo)
    base = previous if previous is not None else eplb.Placement.contiguous(topo)
    before = eplb.imbalance(eplb.gpu_loads(loads, base))
    if args.out and not Path(args.out).parent.is_dir():
        raise ValueError(f"--out {args.out}: directory {Path(args.out).parent} does not exist")
    plan = eplb.rebalance(loads, topo, args.policy, previous=previous, **bounds, **_planning(args))
    replicated = (plan.logcnt > 1).sum(axis=1)
    print(f"loads: {source}")
    print(f"topology: {topo}")
    print(f"policy {plan.policy} -> {plan.policy_used}")
    for note in plan.notes:
        print(f"note: {note}")
    print(f"imbalance before ({'previous' if previous is not None else 'contiguous'}): "
          f"{'  ' if previous is not None else ''}mean {before.mean():.4f}  worst {before.max():.4f}")
    print(f"imbalance after:               mean {plan.mean_imbalance:.4f}  worst {plan.max_imbalance:.4f}")
    print(f"lower bound:                   mean {plan.imbalance_lb.mean():.4f}  worst {plan.imbalance_lb.max():.4f}")
    print(f"replicated experts per layer: min {replicated.min()}  mean {replicated.mean():.1f}  max {replicated.max()}; "
          f"most replicas of one expert: {int(plan.logcnt.max())}")
    print(f"solve time: {plan.solve_seconds * 1e3:.1f} ms")
    if previous is not None:
        total = topo.num_layers * topo.num_slots
        ways = ", ".join(f"{k[len('layers_'):]} {v}" for k, v in plan.extra.items() if k.startswith("layers_") and v)
        print(f"moves: {plan.total_moves} of {total} slots ({100 * plan.total_moves / total:.1f} %)" + (f"; layers {ways}" if ways else ""))
    if args.expert_bytes is not None:
        tp = transfer_plan(previous, plan.placement, topo, expert_bytes=args.expert_bytes)
        kinds = tp.kind_counts()
        print(f"transfers: {tp.num_transfers} ({kinds['local']} local, {kinds['intra-node']} intra-node, "
              f"{kinds['inter-node']} inter-node); per gpu sent max {tp.sent_bytes.max() / 1e6:.1f} MB "
              f"(mean {tp.sent_bytes.mean() / 1e6:.1f}), received max {tp.received_bytes.max() / 1e6:.1f} MB; "
              f"cross-node {tp.cross_node_bytes / 1e9:.2f} GB")
    if args.out:
        out = Path(args.out)
        if out.suffix == ".npy" and args.format is None:
            np.save(out, plan.phy2log)
            print(f"wrote phy2log {list(plan.phy2log.shape)} to {out}")
        else:
            stats = plan.summary() | {"source": source, "imbalance": plan.imbalance.tolist(), "imbalance_lb": plan.imbalance_lb.tolist()}
            kind = eio.write_placement(out, plan.placement, args.format, stats=stats, loads=loads)
            print(f"wrote {kind} placement to {out}")
    return 0


# Policies that take the anytime search's options; ilp takes only the time limit and workers.
_SEARCHING = ("global", "hierarchical", "auto")


def _planning(args: argparse.Namespace) -> dict:
    """The planning options of ``eplb place`` as ``rebalance`` options for ``args.policy``."""
    given = {
        "effort": args.effort,
        "work_budget": args.work_budget,
        "time_limit": args.time_limit,
        "workers": args.workers,
    }
    given = {k: v for k, v in given.items() if v is not None}
    allowed = ("effort", "work_budget", "time_limit", "workers") if args.policy in _SEARCHING else ()
    if args.policy == "ilp":
        allowed = ("time_limit", "workers")
    extra = sorted(set(given) - set(allowed))
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        raise ValueError(f"{flags} do(es) not apply to --policy {args.policy}; they apply to {', '.join(_SEARCHING)}"
                         + (" (ilp: --time-limit, --workers)" if args.policy != "ilp" else ""))
    return given


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eplb", description="Expert-parallel load balancer for MoE inference.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "place",
        help="plan a placement from a load trace (or a synthetic workload) and write it",
        description="Plan a placement from TRACE (formats: docs/tools.md) or, without TRACE, from a "
        "built-in synthetic workload, print a short report and write the placement.",
    )
    p.add_argument("trace", nargs="?", help="load trace file (.json .npy .npz .csv .pt)")
    p.add_argument("--trace-format", choices=eio.TRACE_FORMATS, help="trace format (default: by suffix)")
    p.add_argument("--recorded-under", metavar="PLACEMENT", help="placement a vLLM window of physical counts was recorded under (any placement format or .npy phy2log)")
    p.add_argument("--synthetic", "--workload", dest="synthetic", default="lognormal-1.0", choices=WORKLOADS, help="workload when no TRACE is given")
    p.add_argument("--scale", choices=sorted(SCALES), help="standard topology (docs/scales.md)")
    p.add_argument("--topology", help="topology config file (.json or .toml: layers, experts, slots, gpus, nodes, groups)")
    for name in _TOPO_ARGS:
        p.add_argument(f"--{name}", type=int, help=f"number of {name}" + (" (default: the trace's)" if name in ("layers", "experts") else ""))
    window = p.add_mutually_exclusive_group()
    window.add_argument("--window", type=int, help="plan on the last N steps of a trace with a time axis")
    window.add_argument("--half-life", type=float, help="plan on an exponentially decayed sum (half-life in steps)")
    p.add_argument("--policy", default="auto", choices=eplb.policies())
    p.add_argument("--previous", metavar="PLACEMENT", help="the placement in service now (any placement format or .npy "
                   "phy2log): re-plan migration-aware, moving as few slots as the bounds allow")
    p.add_argument("--tolerance", type=float, help="with --previous: mean imbalance over layers within (1 + this) x a fresh plan's [0.01]")
    p.add_argument("--layer-tolerance", type=float, help="with --previous: every layer within (1 + this) x fresh's [0.05]")
    p.add_argument("--max-moves", type=int, help="with --previous: at most this many slots rewritten in all (a hard limit)")
    p.add_argument("--max-layer-moves", type=int, help="with --previous: at most this many slots rewritten per layer")
    p.add_argument("--expert-bytes", type=float, help="with --previous: bytes of one expert's weights; prints the transfer plan's traffic")
    p.add_argument("--effort", choices=("fast", "default", "high"), help="fast: the first greedy plan; default: then search "
                   "until within 0.1 %% of the bound or the work budget is spent; high: wider and longer [default]")
    p.add_argument("--work-budget", type=float, help="work units per layer for the search after the first plan "
                   "(deterministic; default: the effort's)")
    p.add_argument("--time-limit", type=float, help="wall-clock seconds for the whole plan (cuts the search short; "
                   "no limit by default; ilp: one limit over all layers)")
    p.add_argument("--workers", type=int, help="processes planning layers in parallel [1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=eio.PLACEMENT_FORMATS, help="placement format (default: by --out suffix; .npy writes bare phy2log)")
    p.add_argument("--out", help="write the placement here (.json native, .npz vllm, .txt listing, .npy phy2log)")
    p.set_defaults(fn=_place)
    s = sub.add_parser("serve", help="run the balancer service (eplb serve --help)", add_help=False)
    s.set_defaults(fn=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        # Imported here so `eplb place` works without the service extra installed.
        from eplb_service.cli import main as serve_main

        return serve_main(rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

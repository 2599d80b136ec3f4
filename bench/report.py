"""eplb-bench: imbalance report over policies x workloads x scales (and trace files).

Three sections, each a Markdown table on stdout (and a list in --json):

  placement     per (scale, workload): the baselines none (contiguous placement) and
                deepseek, our policies, ilp on the small scale, and the lower bound:
                imbalance (mean over layers, worst layer), gap to the lower bound, gap to
                the ILP, solve time per full-model plan.
  re-planning   imbalance over a drifting and a shifting sequence when each policy
                re-plans every K steps on the last K steps (migration-aware), and the
                slots each re-plan moves. Runs at v3-prefill, or at each of --scales.
  per-step      realized max/mean gpu load of sampled decode steps at b tokens per gpu,
                mean and p99, next to the placement's expected imbalance. Runs at
                v4flash-ep64, or at each of --scales.

Scales and workloads: docs/scales.md. More: docs/tools.md.

examples:
  eplb-bench --quick                          two scales, three workloads, under a minute
  eplb-bench --scales small --policies global,ilp
  eplb-bench trace.npy --slots 288 --gpus 32 --json report.json   only the trace
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

import eplb
from eplb.loads import check_layer_sums
from eplb.policies.deepseek import FLOAT32_LAYER_SUM
from eplb.simulate import simulate_steps
from eplb.topology import Topology
from eplb.workloads import SCALES, WORKLOADS, drift, make_loads, shift
from eplb_tools import extras
from eplb_tools import io as eio
from eplb_tools.args import OneLineParser
from eplb_tools.cli import ProgressLines, build_topology, check_plan_fits, progress_lines
from eplb_tools.pipes import INTERRUPTED_STATUS, quiet_on_broken_pipe

try:
    from tqdm import tqdm
except ImportError:  # the bench extra: without it no progress bars, as in eplb place

    def tqdm(iterable: Iterable[T], **_: object) -> Iterable[T]:
        return iterable


def _each(items: list[T], section: str) -> Iterable[T]:
    """``items`` with progress on stderr: a bar on a terminal, else a line every few seconds, so
    a report run with ``2>log`` is not silent for the whole run."""
    if sys.stderr.isatty():
        return tqdm(items, desc=section)
    return progress_lines(items, f"eplb-bench: {section}")


OUR_POLICIES = ("global", "hierarchical", "auto")
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    """One instance to plan: ``loads [L, E]`` on a topology; a trace with a time axis also
    keeps its ``sequence [T, L, E]`` for the re-planning section."""

    scale: str
    workload: str
    topology: Topology
    loads: np.ndarray
    sequence: np.ndarray | None = None


def policies_for(topology: Topology, scale: str, requested: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """``none`` (contiguous) always, then ``requested`` (default: ``deepseek`` and ours, and
    ``ilp`` on ``small`` when registered). ``ilp`` asked for elsewhere gets a skipped row."""
    if requested is None:
        requested = ("deepseek", *OUR_POLICIES) + (("ilp",) if scale == "small" and "ilp" in eplb.policies() else ())
    return ("none", *(n for n in requested if n != "none"))


def check_policies(requested: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming any of ``requested`` the registry does not know."""
    unknown = [n for n in requested if n not in eplb.policies() and n != "none"]
    if unknown:
        raise ValueError(
            f"--policies: unknown {', '.join(map(repr, unknown))}; registered policies: "
            f"{', '.join(eplb.policies())} (the contiguous baseline 'none' always runs)"
        )


class PolicyFailure(Exception):
    """A policy raised on a case it applies to: its bug (e.g. ``eplb.PolicyError``, an invalid
    plan), which fails the run rather than showing as a skipped row."""

    def __init__(self, policy: str, case: str, exc: BaseException) -> None:
        detail = " ".join(str(exc).split())  # one line, whatever the policy's message holds
        super().__init__(f"policy {policy!r} failed on {case}: {type(exc).__name__}: {detail}")


def _skip_reason(policy: str, topology: Topology, scale: str = "", loads: np.ndarray | None = None) -> str | None:
    """Why ``policy`` does not apply to this case (a row saying so), or None: it must plan it."""
    if policy == "hierarchical" and not topology.hierarchical_ok:
        return f"num_groups ({topology.num_groups}) % num_nodes ({topology.num_nodes}) != 0"
    if policy == "ilp" and scale != "small" and not scale.startswith("trace"):
        # One CP-SAT model per layer: minutes to hours at the model scales.
        return "ilp runs on the small scale and trace files only"
    if policy == "ilp" and topology.num_slots > topology.num_experts * topology.num_gpus:
        return (
            f"ilp keeps at most one replica of an expert per gpu: num_slots ({topology.num_slots}) > "
            f"num_experts x num_gpus ({topology.num_experts * topology.num_gpus})"
        )
    if policy == "deepseek" and loads is not None:
        try:  # eplb.py's float32 arithmetic: the library's own check and message
            check_layer_sums(loads, FLOAT32_LAYER_SUM, "loads", "policy 'deepseek' computes in float32 as eplb.py does")
        except ValueError as exc:
            return str(exc)
    return None


def plan_case(
    case: Case, policy: str, ilp_time_limit: float = 10.0
) -> tuple[dict, eplb.Placement | None, np.ndarray | None]:
    """One row: ``policy`` on ``case``, figures from ``eplb.metrics``; also the placement and
    its per-layer imbalance ``[L]`` (None when skipped)."""
    topo, loads = case.topology, case.loads
    row: dict = {"scale": case.scale, "workload": case.workload, "policy": policy}
    lb = eplb.imbalance_lb(loads, topo)
    row["imbalance_lb_mean"] = float(lb.mean())
    reason = _skip_reason(policy, topo, case.scale, loads)
    if reason:
        return row | {"skipped": reason}, None, None
    if policy == "none":
        placement, seconds = eplb.Placement.contiguous(topo), None
    else:
        try:
            t0 = time.perf_counter()
            options = {"time_limit": ilp_time_limit} if policy == "ilp" else {}
            # Without a terminal (where the bar over the cases shows), a plan that runs long
            # (ilp: one CP-SAT solve per layer) says how far it got, as eplb place does.
            lines = (
                None
                if sys.stderr.isatty()
                else ProgressLines(False, f"eplb-bench: {policy} on {case.scale}/{case.workload}")
            )
            try:
                plan = eplb.rebalance(loads, topo, policy, progress=lines, **options)
            finally:
                if lines is not None:
                    lines.close()
            seconds = time.perf_counter() - t0
        except ImportError as exc:  # a missing extra: ilp without OR-Tools, a plugin's dependency
            return row | {"skipped": str(exc)}, None, None
        except Exception as exc:  # noqa: BLE001  (whatever it is, the policy failed where it applies)
            raise PolicyFailure(policy, f"{case.scale} / {case.workload}", exc) from exc
        placement = plan.placement
        if plan.solver_status:
            row["solver_status"] = sorted(set(plan.solver_status))
    imb = eplb.imbalance(eplb.gpu_loads(loads, placement))
    row |= {
        "imbalance_mean": float(imb.mean()),
        "imbalance_worst": float(imb.max()),
        "gap_to_lb": float((imb / lb).mean() - 1.0),
    }
    if seconds is not None:
        row["solve_seconds"] = seconds
    return row, placement, imb


def add_ilp_gap(rows: list[dict]) -> None:
    """Fill ``gap_to_ilp`` (mean imbalance over the ILP's, minus 1) where an ILP row exists."""
    ilp = {
        (r["scale"], r["workload"]): r["imbalance_mean"] for r in rows if r["policy"] == "ilp" and "skipped" not in r
    }
    for r in rows:
        key = (r["scale"], r["workload"])
        if key in ilp and "skipped" not in r:
            r["gap_to_ilp"] = r["imbalance_mean"] / ilp[key] - 1.0


def replan_series(topology: Topology, seq: np.ndarray, policy: str, every: int, where: str = "a sequence") -> dict:
    """``seq``: ``[T, L, E]``. Re-plan every ``every`` steps on the last ``every`` steps
    (the first plan uses step 0) and score each step with the placement in service then;
    ``PolicyFailure`` (naming ``where``) when the policy raises, but for an ``ImportError``
    (a missing extra), which passes through.

    Returns ``imbalance [T]`` (mean over layers), ``replan_steps [R]`` and ``moves [R]``
    (slots changed by each re-plan after the first).
    """
    T = seq.shape[0]
    steps = np.arange(0, T, every)
    placement = None
    moves, imbalance = [], np.empty(T)
    for t in range(T):
        if t % every == 0 and policy != "none":
            window = seq[0] if t == 0 else seq[max(0, t - every) : t].sum(axis=0)
            try:
                plan = eplb.rebalance(window, topology, policy, previous=placement)
            except ImportError:
                raise
            except Exception as exc:  # noqa: BLE001  (as in plan_case: the policy's failure)
                raise PolicyFailure(policy, f"{where} (re-planning at step {t})", exc) from exc
            if placement is not None:
                moves.append(int(plan.moves.sum()))
            placement = plan.placement
        elif placement is None:
            placement = eplb.Placement.contiguous(topology)
        imbalance[t] = eplb.imbalance(eplb.gpu_loads(seq[t], placement)).mean()
    return {
        "imbalance": imbalance,
        "replan_steps": steps[1:],
        "moves": np.array(moves if policy != "none" else [0] * (len(steps) - 1)),
    }


def replan_rows(
    scale: str, topology: Topology, name: str, seq: np.ndarray, policies: tuple[str, ...], every: int
) -> tuple[list[dict], dict]:
    rows, series = [], {}
    for policy in policies:
        if policy == "ilp" or _skip_reason(policy, topology, scale, seq.sum(axis=0)):
            continue
        try:
            s = replan_series(topology, seq, policy, every, f"{scale} / {name}")
        except ImportError:  # a missing extra: its placement row says so
            continue
        series[policy] = s
        rows.append(
            {
                "scale": scale,
                "sequence": name,
                "policy": policy,
                "steps": int(seq.shape[0]),
                "replan_every": every,
                "imbalance_mean": float(s["imbalance"].mean()),
                "imbalance_max": float(s["imbalance"].max()),
                "moves_per_replan": float(s["moves"].mean()) if s["moves"].size else 0.0,
                "moved_fraction": float(s["moves"].mean() / topology.num_slots / topology.num_layers)
                if s["moves"].size
                else 0.0,
            }
        )
    return rows, series


def step_rows(
    scale: str,
    topology: Topology,
    workload: str,
    popularity: np.ndarray,
    placements: dict[str, eplb.Placement],
    tokens_per_gpu: tuple[int, ...],
    topk: int,
    steps: int,
    layer: int,
) -> list[dict]:
    """Per-step realized imbalance of ``layer`` under ``popularity [E]`` for each placement."""
    rows = []
    for policy, placement in placements.items():
        for b in tokens_per_gpu:
            st = simulate_steps(popularity, placement, b, topk, steps, layer=layer, seed=b)
            rows.append({"scale": scale, "workload": workload, "policy": policy, "layer": layer} | st.summary())
    return rows


def _fmt(row: dict, key: str, spec: str = ".4f", scale: float = 1.0) -> str:
    return format(row[key] * scale, spec) if key in row else ""


def markdown(report: dict) -> str:
    """The three tables of a report dict (``build_report``'s output)."""
    out = [
        "## placement",
        "",
        "| scale | workload | policy | imbalance mean | imbalance worst | lower bound | gap to lb % | gap to ilp % | solve ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    timed = any("predicted_ms" in r for r in report["placement"])
    if timed:
        out[-2] = out[-2][:-1] + "| predicted MoE ms per step |"
        out[-1] += "---|"
    for r in report["placement"]:
        if "skipped" in r:
            out.append(
                f"| {r['scale']} | {r['workload']} | {r['policy']} | skipped: {r['skipped']} | | {r['imbalance_lb_mean']:.4f} | | | |"
            )
            continue
        out.append(
            f"| {r['scale']} | {r['workload']} | {r['policy']} | {_fmt(r, 'imbalance_mean')} | {_fmt(r, 'imbalance_worst')} | "
            f"{_fmt(r, 'imbalance_lb_mean')} | {_fmt(r, 'gap_to_lb', '.2f', 100)} | {_fmt(r, 'gap_to_ilp', '.2f', 100)} | "
            f"{_fmt(r, 'solve_seconds', '.2f', 1e3)} |"
            + (
                (
                    " " + ", ".join(f"{v:.3f} at {b}" for b, v in r["predicted_ms"].items()) + " |"
                    if "predicted_ms" in r
                    else " |"
                )
                if timed
                else ""
            )
        )
    # A section with no rows (a trace-only run has no per-step rows, a one-step trace no
    # re-planning) is left out rather than printed as an empty table.
    if report["replan"]:
        out += [
            "",
            "## re-planning",
            "",
            "| scale | sequence | policy | steps | every | imbalance mean | imbalance max | moves per re-plan | moved fraction | moved GB per re-plan |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in report["replan"]:
        gb = f"{r['moved_bytes_per_replan'] / 1e9:.2f}" if r.get("moved_bytes_per_replan") else ""
        out.append(
            f"| {r['scale']} | {r['sequence']} | {r['policy']} | {r['steps']} | {r['replan_every']} | {r['imbalance_mean']:.4f} | "
            f"{r['imbalance_max']:.4f} | {r['moves_per_replan']:.1f} | {r['moved_fraction']:.3f} | {gb} |"
        )
    if report["steps"]:
        out += [
            "",
            "## per-step (sampled routing)",
            "",
            "| scale | workload | policy | layer | tokens/gpu b | top-k | steps | expected max/mean | realized mean | realized p99 |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in report["steps"]:
        out.append(
            f"| {r['scale']} | {r['workload']} | {r['policy']} | {r['layer']} | {r['tokens_per_gpu']} | {r['topk']} | {r['steps']} | "
            f"{r['expected_ratio']:.4f} | {r['ratio_mean']:.4f} | {r['ratio_p99']:.4f} |"
        )
    return "\n".join(out)


@dataclass(frozen=True)
class Settings:
    scales: tuple[str, ...]
    workloads: tuple[str, ...]
    policies: tuple[str, ...] | None
    replan_scales: tuple[str, ...]
    replan_steps: int
    replan_every: int
    step_scales: tuple[str, ...]
    tokens_per_gpu: tuple[int, ...]
    sim_steps: int
    topk: int
    layer: int
    ilp_time_limit: float
    expert_bytes: float = 0.0
    # A kernel model (eplb.kernel): each placement's predicted MoE ms per step at tokens_per_gpu.
    kernel_curve: str = ""


QUICK = Settings(
    ("v3-prefill", "small"),
    ("zipf-1.0", "lognormal-1.0", "group-limited"),
    None,
    ("v3-prefill",),
    16,
    4,
    ("v4flash-ep64",),
    (32, 240),
    50,
    6,
    0,
    2.0,
)
FULL = Settings(
    tuple(SCALES), WORKLOADS, None, ("v3-prefill",), 64, 8, ("v4flash-ep64",), (32, 240, 1024), 200, 6, 0, 10.0
)


def build_report(settings: Settings, trace_cases: list[Case] = (), plots: Path | None = None) -> dict:
    """Run every section; returns ``{"placement": rows, "replan": rows, "steps": rows, "plots": paths}``.

    A policy that fails on a case it applies to (``PolicyFailure``) stops the run: the report
    then holds the rows made before it and ``"failed"``, one line naming the policy, the case
    and the error (no plots)."""
    report: dict = {"placement": [], "replan": [], "steps": [], "plots": []}
    try:
        _run_sections(settings, list(trace_cases), plots, report)
    except PolicyFailure as exc:
        add_ilp_gap(report["placement"])
        report["failed"] = str(exc)
    return report


def _run_sections(settings: Settings, trace_cases: list[Case], plots: Path | None, report: dict) -> None:
    """Appends each section's rows to ``report``'s lists as they are made."""
    cases = [Case(s, w, SCALES[s], make_loads(w, SCALES[s])) for s in settings.scales for w in settings.workloads]
    cases += trace_cases
    tasks = [(c, p) for c in cases for p in policies_for(c.topology, c.scale, settings.policies)]
    rows, per_case = report["placement"], {}
    for case, policy in _each(tasks, "placement"):
        row, placement, imb = plan_case(case, policy, settings.ilp_time_limit)
        if placement is not None and settings.kernel_curve and case.topology.num_experts >= settings.topk:
            from eplb.timing import predicted_layer_us

            us = predicted_layer_us(
                placement, case.loads, settings.kernel_curve, list(settings.tokens_per_gpu), settings.topk
            ).sum(axis=0)
            row["predicted_ms"] = {int(b): round(float(u) / 1000.0, 4) for b, u in zip(settings.tokens_per_gpu, us)}
        rows.append(row)
        if placement is not None:
            per_case.setdefault((case.scale, case.workload), {})[policy] = (placement, imb)
    add_ilp_gap(rows)

    sequences = []
    for scale in settings.replan_scales:
        base = make_loads("lognormal-1.0", SCALES[scale])
        sequences += [
            (scale, SCALES[scale], "drift-0.05", drift(base, 0.05, settings.replan_steps)),
            (scale, SCALES[scale], "shift", shift(base, settings.replan_steps)),
        ]
    for c in trace_cases:
        if c.sequence is None or len(c.sequence) <= 1:
            continue
        if len(c.sequence) <= settings.replan_every:
            # Planned at step 0 and never re-planned: a row would claim 0 moves per re-plan.
            print(
                f"eplb-bench: note: {c.workload} has {len(c.sequence)} steps, so re-planning every "
                f"{settings.replan_every} never re-plans; it is left out of the re-planning section "
                f"(--replan-every K below {len(c.sequence)} includes it)",
                file=sys.stderr,
            )
            continue
        sequences.append((c.scale, c.topology, c.workload, c.sequence))
    replan, series = report["replan"], {}
    for scale, stopo, name, seq in _each(sequences, "re-planning"):
        r, s = replan_rows(
            scale, stopo, name, seq, policies_for(stopo, scale, settings.policies), settings.replan_every
        )
        for row in r:
            row["moved_bytes_per_replan"] = row["moves_per_replan"] * settings.expert_bytes
        replan += r
        series[(scale, name)] = s

    steps = report["steps"]
    for scale in settings.step_scales:
        stopo = SCALES[scale]
        uniform = np.ones(stopo.num_experts)
        balanced = {"global": eplb.rebalance(uniform[None].repeat(stopo.num_layers, 0), stopo, "global").placement}
        steps += step_rows(
            scale,
            stopo,
            "uniform",
            uniform,
            balanced,
            settings.tokens_per_gpu,
            settings.topk,
            settings.sim_steps,
            settings.layer,
        )
        loads = make_loads("lognormal-1.0", stopo)
        placed = {p: eplb.rebalance(loads, stopo, p).placement for p in ("deepseek", "global")}
        steps += step_rows(
            scale,
            stopo,
            "lognormal-1.0",
            loads[settings.layer],
            placed,
            settings.tokens_per_gpu[:1],
            settings.topk,
            settings.sim_steps,
            settings.layer,
        )

    if plots is not None:
        report["plots"] = [str(p) for p in write_plots(plots, cases, per_case, rows, series, settings)]


def write_plots(
    out: Path, cases: list[Case], per_case: dict, rows: list[dict], series: dict, settings: Settings
) -> list[Path]:
    from eplb_tools import plots  # matplotlib only when plots are asked for

    paths = []
    for case in cases:
        placed = per_case.get((case.scale, case.workload), {})
        if not placed:
            continue
        layer = min(settings.layer, case.topology.num_layers - 1)
        tag = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{case.scale}_{Path(case.workload).name}")
        bars = {p: eplb.gpu_loads(case.loads, pl)[layer] for p, (pl, _) in placed.items()}
        paths.append(
            plots.gpu_load_bars(
                out / f"gpu_load_{tag}_layer{layer}.png", bars, f"{case.scale} {case.workload}: gpu load, layer {layer}"
            )
        )
        per_layer = plots.imbalance_per_layer(
            out / f"imbalance_per_layer_{tag}.png",
            {p: imb for p, (_, imb) in placed.items()},
            eplb.imbalance_lb(case.loads, case.topology),
            f"{case.scale} {case.workload}: imbalance per layer",
        )
        if per_layer is not None:  # None for one layer
            paths.append(per_layer)
        # The heatmap of the last of our policies that ran, beside the contiguous placement
        # (one layer: the bars above say it all).
        ours = [p for p in placed if p in OUR_POLICIES]
        if ours and "none" in placed and case.topology.num_layers > 1:
            paths.append(
                plots.placement_heatmap(
                    out / f"placement_{tag}_{ours[-1]}.png",
                    case.loads,
                    placed[ours[-1]][0],
                    placed["none"][0],
                    title=f"{case.scale} {case.workload}: {ours[-1]} beside the contiguous placement",
                    label=ours[-1],
                    previous_label="none (contiguous)",
                    mark_moves=False,
                )
            )
    for (scale, name), by_policy in series.items():
        steps = next(iter(by_policy.values()))["replan_steps"] if by_policy else np.array([])
        tag = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{scale}_{Path(name).name}")
        paths.append(
            plots.imbalance_over_time(
                out / f"imbalance_over_time_{tag}.png",
                {p: s["imbalance"] for p, s in by_policy.items()},
                {p: s["moves"] for p, s in by_policy.items()},
                steps,
                f"{scale} {name}: re-plan every {settings.replan_every} steps",
            )
        )
    seconds: dict[str, dict[str, float]] = {}
    for r in rows:
        if "solve_seconds" in r and r["policy"] != "none":
            seconds.setdefault(r["policy"], {}).setdefault(r["scale"], []).append(r["solve_seconds"])
    medians = {p: {s: float(np.median(v)) for s, v in by.items()} for p, by in seconds.items()}
    most = max((len(v) for by in seconds.values() for v in by.values()), default=1)
    paths.append(plots.solve_time_by_scale(out / "solve_time_by_scale.png", medians, most))
    return paths


_DEPLOYMENT_FLAGS = ("topology", "slots", "gpus", "nodes", "groups")


def _check_deployment_flags(args: argparse.Namespace) -> None:
    """The flags that give trace files their deployment: only with trace files (the scales have
    their own), and counts >= 1, named by the flag."""
    given = ["--" + n for n in _DEPLOYMENT_FLAGS if getattr(args, n) is not None]
    if given and not args.traces:
        raise ValueError(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to trace files (the deployment they were "
            "recorded on); none was given, and the scales have their own (docs/scales.md)"
        )
    for name in _DEPLOYMENT_FLAGS[1:]:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a number >= 1, got {value}")


def _trace_topology(args: argparse.Namespace, path: str, layers: int, experts: int) -> Topology:
    """The deployment of a trace file: ``--topology``, then ``--slots/--gpus/--nodes/--groups``
    (which win, as in ``eplb place``); layers and experts default to the trace's."""
    values: dict[str, int] = {"layers": layers, "experts": experts, "nodes": 1, "groups": 1}
    origins = {"layers": "from the trace", "experts": "from the trace"}
    if args.topology:
        t = eio.read_topology(args.topology)
        values = {n: getattr(t, f"num_{n}") for n in ("layers", "experts", "slots", "gpus", "nodes", "groups")}
        origins = dict.fromkeys(values, f"from {args.topology}")
    for name in _DEPLOYMENT_FLAGS[1:]:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
            origins[name] = f"--{name}"
    if "slots" not in values or "gpus" not in values:
        raise ValueError(f"{path}: give the deployment for trace files with --topology CONFIG or --slots and --gpus")
    return build_topology(values, origins)


def _trace_cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for path in args.traces:
        trace = eio.read_trace(path)
        topo = _trace_topology(args, path, trace.num_layers, trace.num_experts)
        if (topo.num_layers, topo.num_experts) != (trace.num_layers, trace.num_experts):
            raise ValueError(
                f"{path}: the trace has {trace.num_layers} layers x {trace.num_experts} experts; the topology says "
                f"{topo.num_layers} x {topo.num_experts}"
            )
        check_plan_fits(topo)  # before any policy allocates for it (as eplb place)
        cases.append(Case(f"trace({topo.num_gpus} gpus)", str(path), topo, trace.window(), trace.counts))
    return cases


def _names(text: str) -> tuple[str, ...]:
    # A name given twice is run once (small,small ran every section twice over).
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    # Its own parse, so that 0 and 4,8 get the same message: what this option takes.
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected one integer >= 1, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="eplb-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "traces",
        nargs="*",
        help="load trace files to add as workloads (all steps summed); given alone "
        "(without --quick or --scales), the report covers only them",
    )
    ap.add_argument(
        "--quick", action="store_true", help="two scales, three workloads, short sequences (under a minute)"
    )
    ap.add_argument(
        "--scales",
        type=_names,
        metavar="A,B",
        help=f"comma-separated, for every section (default: all; known: {', '.join(SCALES)})",
    )
    ap.add_argument(
        "--workloads", type=_names, metavar="A,B", help=f"comma-separated (default: all; known: {', '.join(WORKLOADS)})"
    )
    ap.add_argument(
        "--policies",
        type=_names,
        metavar="A,B",
        help=f"comma-separated policies besides the baseline 'none' "
        f"(default: deepseek and ours; registered: {', '.join(eplb.policies())})",
    )
    ap.add_argument("--layer", type=int, default=0, help="layer for the per-gpu bars and the per-step simulation [0]")
    ap.add_argument(
        "--tokens-per-gpu", type=_positive_ints, metavar="B,B", help="comma-separated b for the per-step simulation"
    )
    ap.add_argument(
        "--replan-every",
        type=_positive_int,
        metavar="K",
        help="K: re-plan every K steps of the drifting/shifting sequences",
    )
    ap.add_argument("--topology", help="topology config for trace files (.json/.toml)")
    for name in ("slots", "gpus"):
        ap.add_argument(
            f"--{name}",
            type=int,
            help=f"{name} for trace files (with --{'gpus' if name == 'slots' else 'slots'}; overrides --topology)",
        )
    ap.add_argument("--nodes", type=int, help="nodes for trace files [1]")
    ap.add_argument("--groups", type=int, help="expert groups for trace files [1]")
    ap.add_argument("--ilp-time-limit", type=float, help="seconds per layer for the ilp policy (quick: 2, full: 10)")
    ap.add_argument("--expert-bytes", type=float, help="bytes of one expert's weights: adds moved bytes per re-plan")
    ap.add_argument(
        "--kernel-curve",
        metavar="MODEL",
        help="a shipped kernel model (eplb.kernel.shipped()): add each placement's predicted MoE ms per step at "
        "--tokens-per-gpu (top-6 as the per-step simulation)",
    )
    ap.add_argument("--json", help="also write the report as JSON to this file")
    ap.add_argument("--plots", help="write PNG plots into this directory")
    return ap


def _settings(args: argparse.Namespace) -> Settings:
    """``--quick`` or the full settings with the flags applied; ``ValueError`` on bad names."""
    _check_deployment_flags(args)
    settings = QUICK if args.quick else FULL
    overrides: dict = {"layer": args.layer}
    if args.scales:
        unknown = [s for s in args.scales if s not in SCALES]
        if unknown:
            raise ValueError(
                f"--scales: unknown {', '.join(map(repr, unknown))}; known: {', '.join(SCALES)} (docs/scales.md)"
            )
        overrides |= {"scales": args.scales, "replan_scales": args.scales, "step_scales": args.scales}
    elif args.traces and not args.quick:
        # Trace files alone: a report on them, not also on every synthetic scale (minutes).
        overrides |= {"scales": (), "replan_scales": (), "step_scales": ()}
        unused = [f for f, v in (("--workloads", args.workloads), ("--tokens-per-gpu", args.tokens_per_gpu)) if v]
        if unused:
            raise ValueError(
                f"{', '.join(unused)} appl{'ies' if len(unused) == 1 else 'y'} to the synthetic scales, and trace "
                "files given alone are all the report covers: add --scales A,B (or --quick) to run them too"
            )
    if args.workloads:
        unknown = [w for w in args.workloads if w not in WORKLOADS]
        if unknown:
            raise ValueError(
                f"--workloads: unknown {', '.join(map(repr, unknown))}; known: {', '.join(WORKLOADS)} (docs/scales.md)"
            )
        overrides["workloads"] = args.workloads
    if args.policies:
        check_policies(args.policies)
        overrides["policies"] = args.policies
    if args.kernel_curve is not None:
        from eplb import kernel

        kernel.load(args.kernel_curve)  # an unknown name fails here, before any plan
        overrides["kernel_curve"] = args.kernel_curve
    for name in ("tokens_per_gpu", "replan_every", "ilp_time_limit", "expert_bytes"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    settings = Settings(**(settings.__dict__ | overrides))
    if args.expert_bytes is not None and not (math.isfinite(args.expert_bytes) and args.expert_bytes > 0):
        # As eplb place: the bytes of one expert's weights, a finite number > 0.
        raise ValueError(f"--expert-bytes must be a number of bytes > 0, got {args.expert_bytes}")
    if settings.replan_scales and settings.replan_every >= settings.replan_steps:
        raise ValueError(
            f"--replan-every must be below the {settings.replan_steps} steps of the drifting and shifting sequences "
            f"(every {settings.replan_every} steps there would be no re-plan after the first plan), "
            f"got {settings.replan_every}"
        )
    if not (math.isfinite(settings.ilp_time_limit) and settings.ilp_time_limit > 0):
        # inf as in eplb place's --time-limit: no limit is not a limit.
        raise ValueError(
            f"--ilp-time-limit must be a positive number of seconds, got {settings.ilp_time_limit}"
            + ("" if math.isfinite(settings.ilp_time_limit) else " (not a finite number)")
        )
    if settings.layer < 0:
        raise ValueError(f"--layer must be >= 0, got {settings.layer}")
    for scale in settings.step_scales:
        layers = SCALES[scale].num_layers
        if settings.layer >= layers:
            raise ValueError(
                f"--layer must be between 0 and {layers - 1} (the per-step scale {scale} has {layers} "
                f"layer{'s' if layers > 1 else ''}), got {settings.layer}"
            )
    topk = settings.topk
    small = [s for s in settings.step_scales if SCALES[s].num_experts < topk]
    if small:
        raise ValueError(f"the per-step simulation routes each token to {topk} experts; scale {small[0]} has fewer")
    return settings


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    # Plugin policies first, as in eplb place, so that --policies (and its help) knows them.
    from eplb_service import plugins

    try:
        plugins.load(plugins.parse(os.environ.get("EPLB_PLUGINS")))
    except ValueError as exc:
        print(f"eplb-bench: error: EPLB_PLUGINS: {exc}", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    try:
        settings = _settings(args)
        if args.plots:
            try:
                extras.require("matplotlib")
            except ImportError as exc:
                raise ValueError(extras.missing("--plots", "bench", exc)) from None
        # Checked before the run, which takes minutes, rather than after it.
        if args.json and not Path(args.json).parent.is_dir():
            raise ValueError(f"--json {args.json}: directory {Path(args.json).parent} does not exist")
        if args.plots and Path(args.plots).exists() and not Path(args.plots).is_dir():
            raise ValueError(f"--plots {args.plots}: is a file; give a directory (made if missing)")
        if args.json and Path(args.json).is_dir():
            raise ValueError(
                f"--json {args.json}: is a directory; give a file name such as {Path(args.json) / 'report.json'}"
            )
        report = build_report(settings, _trace_cases(args), Path(args.plots) if args.plots else None)
    except BrokenPipeError:
        raise  # the reader of stdout went away: quiet_on_broken_pipe ends quietly
    except (ValueError, OSError) as exc:  # OSError: a file that cannot be read or written
        print(f"eplb-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\neplb-bench: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    failed = None
    if args.json:
        # Written before the tables (a reader of stdout that goes away must not lose it); one
        # that cannot be written still leaves the tables of a run of minutes on stdout.
        try:
            Path(args.json).write_text(json.dumps(report, indent=1, default=float))
        except OSError as exc:
            failed = f"eplb-bench: error: --json {args.json}: cannot write it ({exc.strerror or exc})"
    print(markdown(report))
    if report["plots"]:
        print("\nplots:\n" + "\n".join(report["plots"]))
    if failed:
        print(failed, file=sys.stderr)
        return 2
    if "failed" in report:
        print(f"eplb-bench: error: {report['failed']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

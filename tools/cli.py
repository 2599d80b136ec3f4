"""The ``eplb`` command: ``eplb place`` (trace file or synthetic workload → placement file),
``eplb serve`` (the balancer service), ``eplb demo`` (service, engine ranks and mover on CPU) and
``eplb ctl`` (ask a running service, tools/ctl.py), ``eplb bench`` (``eplb-bench``)."""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import numpy as np

import eplb
from eplb.limits import plan_bytes, size_text
from eplb.loads import check_loads
from eplb.topology import Topology
from eplb.transfer import transfer_plan, transfer_schedule
from eplb.workloads import SCALES, WORKLOADS, make_loads

from . import extras
from . import io as eio
from .args import OneLineParser
from .pipes import INTERRUPTED_STATUS, quiet_on_broken_pipe
from .plots_check import plot_target

T = TypeVar("T")

_TOPO_ARGS = ("layers", "experts", "slots", "gpus", "nodes", "groups")


def build_topology(values: dict[str, int], origins: dict[str, str]) -> Topology:
    """``Topology`` from ``values`` (``layers``, ``experts``, ... as in ``_TOPO_ARGS``) whose
    ``origins`` say where each came from (``"--slots"``, ``"from --scale small"``, ``"from the
    trace"``): a ``ValueError`` names the fields by those, not by the library's ``num_*``
    parameters, so that the user sees which flag (or file) to change."""
    try:
        return Topology(*(values[n] for n in _TOPO_ARGS))
    except ValueError as exc:

        def named(m: re.Match) -> str:
            name, value = m.group(1), m.group(2)
            origin = origins.get(name, "")
            return f"{name} ({value}{', ' + origin if origin else ''})"

        raise ValueError(re.sub(r"\bnum_([a-z]+) \((\d+)\)", named, str(exc))) from None


def _topology(args: argparse.Namespace, layers: int | None, experts: int | None) -> Topology:
    """Topology from ``--scale`` or ``--topology``, then explicit flags (which win), with
    layers and experts defaulting to the trace's."""
    base: dict[str, int] = {}
    origins: dict[str, str] = {}
    if args.scale:
        t = SCALES[args.scale]
        base = {n: getattr(t, f"num_{n}") for n in _TOPO_ARGS}
        origins = dict.fromkeys(_TOPO_ARGS, f"from --scale {args.scale}")
    if args.topology:
        t = eio.read_topology(args.topology)
        base = {n: getattr(t, f"num_{n}") for n in _TOPO_ARGS}
        origins = dict.fromkeys(_TOPO_ARGS, f"from {args.topology}")
    base.setdefault("nodes", 1)
    base.setdefault("groups", 1)
    for name, value in (("layers", layers), ("experts", experts)):
        if value is not None and name not in base:
            base[name] = value
            origins[name] = "from the trace"
    for name in _TOPO_ARGS:
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
            origins[name] = f"--{name}"
    missing = [f"--{n}" for n in _TOPO_ARGS if n not in base]
    if missing:
        raise ValueError(f"topology incomplete: give {', '.join(missing)} (or --topology CONFIG / --scale NAME)")
    topo = build_topology(base, origins)
    if layers is not None and (topo.num_layers, topo.num_experts) != (layers, experts):
        raise ValueError(
            f"the trace has {layers} layers x {experts} experts but the topology says "
            f"{topo.num_layers} x {topo.num_experts}; fix --layers/--experts or the config"
        )
    return topo


def _output(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """Where the placement goes and in which format, checked before planning (an ILP plan
    can take an hour): ``(None, fmt)`` for stdout, ``(path, "phy2log")`` for a bare
    ``.npy``, ``(None, None)`` when nothing is to be written."""
    if args.out in (None, "-"):
        if args.format is None:
            return None, ("native" if args.out == "-" else None)
        if args.format == "vllm":
            raise ValueError("--format vllm writes an .npz archive, which is not for a terminal: give --out FILE.npz")
        return None, args.format
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {out}: is a directory; give a file name such as {out / 'placement.json'}")
    if not out.parent.is_dir():
        raise ValueError(f"--out {args.out}: directory {out.parent} does not exist")
    if out.suffix.lower() == ".npy" and args.format is None:
        fmt = "phy2log"
    else:
        try:
            fmt = eio.placement_output_format(out, args.format)
        except ValueError as exc:
            raise ValueError(f"--out {exc}; or .npy for a bare phy2log array") from None
    _check_writable("--out", out)
    return out, fmt


def _check_writable(flag: str, path: Path) -> None:
    """Opens ``path`` for appending (an existing file is not changed; a new one is removed
    again), so that a file that cannot be written is refused before planning, naming ``flag``."""
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write it ({exc.strerror or exc}); give a writable file path") from None
    if not existed:
        path.unlink(missing_ok=True)


def available_bytes() -> int | None:
    """Memory this machine can give a new allocation now (``MemAvailable`` in /proc/meminfo),
    None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_plan_fits(topo: Topology, available: int | None = None, *, replan: bool = False) -> int | None:
    """Refuses, before anything is allocated, a plan (``replan``: from ``--previous``) whose
    estimated memory (``eplb.limits.plan_bytes``) is more than the memory available
    (``available``, default ``available_bytes()``): the kernel would otherwise kill the process
    without a word. Returns the memory available, for ``plan_limit``."""
    available = available_bytes() if available is None else available
    need = plan_bytes(topo, replan=replan)
    if available is not None and need > available:
        raise ValueError(
            f"a plan of {_count(topo.num_layers, 'layers')} x {topo.num_experts} experts on {topo.num_slots} slots "
            f"({topo.slots_per_gpu} per gpu) needs about {size_text(need)} of memory (eplb.limits.plan_bytes), more "
            f"than the {size_text(available)} available (MemAvailable); plan fewer layers, experts or slots per gpu"
        )
    return available


@contextmanager
def plan_limit(available: int | None) -> Iterator[None]:
    """The library's limit on a plan's memory (``eplb.set_max_plan_bytes``) set to the memory
    available while the block runs, where it is known: the tools measure the machine they run
    on, the library's default (``eplb.limits.MAX_PLAN_BYTES``) is for callers that do not."""
    if available is None:
        yield
        return
    old = eplb.set_max_plan_bytes(available)
    try:
        yield
    finally:
        eplb.set_max_plan_bytes(old)


# Numeric flags: (what the value is, the comparison, the limit). Checked here so the error
# names the flag, not the library's parameter.
_NUMBERS = {
    **{name: ("a number", ">=", 1) for name in _TOPO_ARGS},
    "window": ("a number of steps", ">=", 1),
    "half_life": ("a number of steps", ">", 0),
    "tolerance": ("a fraction (0.01 = 1 %)", ">=", 0),
    "layer_tolerance": ("a fraction (0.01 = 1 %)", ">=", 0),
    "max_moves": ("a number of slots", ">=", 0),
    "max_layer_moves": ("a number of slots", ">=", 0),
    "expert_bytes": ("a number of bytes", ">", 0),
    "work_budget": ("a number of work units", ">=", 0),
    "time_limit": ("a number of seconds", ">", 0),
    "workers": ("a number of processes", ">=", 1),
    "seed": ("an integer", ">=", 0),
}
# Flags that only mean something with a TRACE, and those only without one.
_TRACE_ONLY = ("window", "half_life", "trace_format", "recorded_under")
_SYNTHETIC_ONLY = ("synthetic", "seed")


def _check_flags(args: argparse.Namespace) -> None:
    if args.scale and args.topology:
        raise ValueError(
            "give one of --scale NAME and --topology CONFIG (flags such as --gpus then change single fields)"
        )
    # Whether a flag applies at all comes before its range: --window 0 without a TRACE is
    # wrong for want of a TRACE, whatever the window.
    unused = _SYNTHETIC_ONLY if args.trace else _TRACE_ONLY
    given = ["--" + n.replace("_", "-") for n in unused if getattr(args, n) is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} "
            + ("to synthetic workloads, not to a TRACE" if args.trace else "to a TRACE file; none was given")
        )
    for name, (what, op, limit) in _NUMBERS.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value >= limit if op == ">=" else value > limit)):
            # inf passes the comparison but means nothing here (and nan fails it): both named.
            raise ValueError(
                f"--{name.replace('_', '-')} must be {what} {op} {limit}, got {value}"
                + ("" if math.isfinite(value) else " (not a finite number)")
            )
    if not args.trace and not args.synthetic:
        # Planning a default workload nobody asked for, and writing nothing, helps no one.
        raise ValueError(
            "nothing to plan: give a TRACE file, or --synthetic NAME for a built-in workload "
            f"({', '.join(WORKLOADS)}), e.g. eplb place --synthetic lognormal-1.0 --scale v3-prefill --out p.json; "
            "eplb place --help lists the flags"
        )


def _place(args: argparse.Namespace) -> int:
    _check_flags(args)
    if args.policy == "ilp":
        # Found out now, not after reading the trace and at the first layer's solve.
        try:
            extras.require("ortools.sat.python.cp_model")
        except ImportError as exc:
            raise ValueError(extras.missing("--policy ilp", "ilp", exc)) from None
    out, fmt = _output(args)
    plot = plot_target("--plot", args.plot) if args.plot else None
    planning = _planning(args)
    # The placement on stdout keeps stdout clean for a pipe; the report goes to stderr then.
    report = sys.stderr if out is None and fmt is not None else sys.stdout
    if args.trace:
        phy2log = eio.read_phy2log(args.recorded_under) if args.recorded_under else None
        trace = eio.read_trace(args.trace, args.trace_format, phy2log)
        if "duplicate_rows" in trace.meta and eio.trace_format_of(Path(args.trace), args.trace_format) == "csv":
            _warn(f"{args.trace}: {trace.meta['duplicate_rows']}")
        topo = _topology(args, trace.num_layers, trace.num_experts)
        available = check_plan_fits(topo, replan=bool(args.previous))
        if args.window is not None and args.window > trace.num_steps:
            raise ValueError(
                f"--window must be between 1 and the trace's {_count(trace.num_steps, 'steps')}, got {args.window}"
            )
        # Counts near float64's max overflow in the sum; check_loads below names that, without
        # numpy's RuntimeWarning first.
        with np.errstate(over="ignore", invalid="ignore"):
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
        available = check_plan_fits(topo, replan=bool(args.previous))  # before the workload's [L, E] loads too
        workload, seed = args.synthetic, args.seed or 0
        loads = make_loads(workload, topo, seed)
        source = f"synthetic {workload} (seed {seed})"
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
    previous = _read_previous(args.previous, topo) if args.previous else None
    with np.errstate(over="ignore", invalid="ignore"):
        # rebalance checks the loads too; here so the error comes before the figures below,
        # which would overflow (with numpy's warning) on loads too large to plan.
        check_loads(loads, topo)
    if not loads.any():
        # Every placement balances nothing perfectly: "imbalance 1.0" would read as a result.
        _warn(
            f"the loads planned ({source}) are all zero: any placement balances them, so the plan and its "
            "imbalance 1.0 say nothing about a real load"
        )
    base = previous if previous is not None else eplb.Placement.contiguous(topo)
    before = eplb.imbalance(eplb.gpu_loads(loads, base))
    if args.policy == "ilp" and args.time_limit is None:
        print(
            f"eplb place: ilp builds and solves one CP-SAT model per layer ({topo.num_layers} layer"
            f"{'s' if topo.num_layers > 1 else ''}, up to 10 s of solving each after building, no overall limit); "
            "--time-limit S caps the whole run",
            file=sys.stderr,
        )
    timed = _time_flags(args)
    with _progress("eplb place", eager=args.progress) as progress, plan_limit(available):
        plan = eplb.rebalance(
            loads, topo, args.policy, previous=previous, progress=progress, **bounds, **planning, **timed
        )
    replicated = (plan.logcnt > 1).sum(axis=1)
    say = functools.partial(print, file=report)
    say(f"loads: {source}")
    say(f"topology: {topo}")
    say(f"policy {plan.policy} -> {plan.policy_used}")
    for note in plan.notes:
        say(f"note: {note}")
    short = plan.solver.method.count("out of time") if plan.solver else 0  # only under --time-limit
    if short:
        say(
            f"hint: {short} layer{'s' if short > 1 else ''} ran out of time (--time-limit {args.time_limit:g} s over "
            f"{topo.num_layers} layers) before CP-SAT finished building the model of {topo.num_experts} experts x "
            f"{topo.num_gpus} gpus; ilp is a reference for small instances (docs/ilp_and_transfer.md)"
        )
    say(
        f"imbalance before ({'previous' if previous is not None else 'contiguous'}): "
        f"{'  ' if previous is not None else ''}mean {before.mean():.4f}  worst {before.max():.4f}"
    )
    say(f"imbalance after:               mean {plan.mean_imbalance:.4f}  worst {plan.max_imbalance:.4f}")
    say(f"lower bound:                   mean {plan.imbalance_lb.mean():.4f}  worst {plan.imbalance_lb.max():.4f}")
    # How far from optimal the plan can be at most: each layer's imbalance over its bound.
    gap = (
        np.divide(plan.imbalance, plan.imbalance_lb, out=np.ones_like(plan.imbalance), where=plan.imbalance_lb > 0) - 1
    )
    target = getattr(eplb.get_policy(args.policy).defaults(), "gap", None)
    within = (
        f"; {int((gap <= target + 1e-12).sum())} of {topo.num_layers} layers within {100 * target:g} %"
        if target is not None
        else ""
    )
    say(f"gap to the bound:              mean {100 * gap.mean():.2f} %  worst {100 * gap.max():.2f} %{within}")
    if plan.search is not None and (plan.search.layers_searched or plan.search.timed_out):
        say(
            f"search after the first plan:   {plan.search.layers_searched} of {topo.num_layers} layers, "
            f"{plan.search.work:.0f} work units" + ("; cut short by --time-limit" if plan.search.timed_out else "")
        )
    say(
        f"replicated experts per layer: min {replicated.min()}  mean {replicated.mean():.1f}  max {replicated.max()}; "
        f"most replicas of one expert: {int(plan.logcnt.max())}"
    )
    if plan.predicted_ms:
        say(
            "predicted MoE time per step:   "
            + "  ".join(f"{b} tokens/gpu {ms:.3f} ms" for b, ms in plan.predicted_ms.items())
            + f" ({timed['kernel_curve'].gpu or 'a kernel model of no named GPU'}, sum over {topo.num_layers} layers)"
        )
    say(f"solve time: {plan.solve_seconds * 1e3:.1f} ms")
    if previous is not None:
        total = topo.num_layers * topo.num_slots
        ways = ", ".join(f"{k} {v}" for k, v in plan.replan.layers().items() if v) if plan.replan else ""
        say(
            f"moves: {plan.total_moves} of {total} slots ({100 * plan.total_moves / total:.1f} %)"
            + (f"; layers {ways}" if ways else "")
        )
    if args.expert_bytes is not None:
        tp = transfer_plan(previous, plan.placement, topo, expert_bytes=args.expert_bytes)
        kinds = tp.kind_counts()
        say(
            f"transfers: {tp.num_transfers} ({kinds['local']} local, {kinds['intra-node']} intra-node, "
            f"{kinds['inter-node']} inter-node); per gpu sent max {tp.sent_bytes.max() / 1e6:.1f} MB "
            f"(mean {tp.sent_bytes.mean() / 1e6:.1f}), received max {tp.received_bytes.max() / 1e6:.1f} MB; "
            f"cross-node {tp.cross_node_bytes / 1e9:.2f} GB"
        )
        sched = transfer_schedule(previous, plan.placement, topo, expert_bytes=args.expert_bytes)
        bw = sched.bandwidth
        say(
            f"schedule: {sched.total_rounds} rounds over {topo.num_layers} layers (each gpu with at most one peer per round), "
            f"max {sched.max_rank_round_bytes / 1e6:.1f} MB per gpu per round; predicted {sched.predicted_seconds:.3f} s "
            f"at {bw.intra_node_gb_s:g} GB/s same node, {bw.inter_node_gb_s:g} GB/s across nodes, {bw.local_gb_s:g} GB/s within a gpu"
        )
    stats = plan.summary() | {
        "source": source,
        "imbalance": plan.imbalance.tolist(),
        "imbalance_lb": plan.imbalance_lb.tolist(),
    }
    if fmt is None:
        say(
            "placement not written: give --out FILE (.json native, .npz vllm, .txt listing, .npy phy2log) "
            "or --format FMT to print it"
        )
    elif out is None:
        _to_stdout(eio.placement_text(plan.placement, fmt, stats, loads))
    elif fmt == "phy2log":
        with out.open("wb") as f:  # np.save(path) would append .npy to a name ending in .NPY
            np.save(f, plan.phy2log)
        say(f"wrote phy2log {list(plan.phy2log.shape)} to {out}")
    else:
        kind = eio.write_placement(out, plan.placement, fmt, stats=stats, loads=loads)
        say(f"wrote {kind} placement to {out}")
    if plot is not None:
        from . import plots  # matplotlib only for --plot

        plots.placement_heatmap(
            plot,
            loads,
            plan.placement,
            previous,
            title=f"eplb place: {source}, policy {plan.policy_used}",
            label=f"plan ({plan.policy_used})",
        )
        say(f"wrote plot to {plot}")
    return 0


def _warn(message: str) -> None:
    print(f"eplb place: warning: {message}", file=sys.stderr)


def _to_stdout(text: str) -> None:
    """Writes the placement to stdout (``--out -``); a stdout that takes no more (a full disk,
    ``> /dev/full``) is one error naming the flag, and the exit's flush is kept quiet."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise  # the reader went away: quiet_on_broken_pipe
    except OSError as exc:
        try:  # what stayed in the buffer would fail again, with a traceback, at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        raise ValueError(
            f"--out -: cannot write the placement to stdout ({exc.strerror or exc}); give --out FILE"
        ) from None


def _count(value: int, plural: str) -> str:
    return f"{value} {plural if value != 1 else plural[:-1]}"


def _read_previous(path: str, topo: Topology) -> eplb.Placement:
    """The ``--previous`` placement on ``topo``. A native or listing file records the topology
    it was planned for: re-planning it under other flags would reuse its slots on gpus they
    were never on, so a mismatch is refused, naming both. Engine formats and a bare ``.npy``
    record only the map, whose shape is checked."""
    p = Path(path)
    recorded = None
    try:
        if p.suffix.lower() != ".npy" and p.is_file() and eio.placement_format_of(p) in ("native", "listing"):
            recorded = eio.read_placement(p).topology
        prev = eio.read_phy2log(path)
    except ValueError:
        _refuse_a_trace(path)
        raise
    if prev.ndim != 2:
        _refuse_a_trace(path)
    if recorded is not None and recorded != topo:
        differ = [n for n in _TOPO_ARGS if getattr(recorded, f"num_{n}") != getattr(topo, f"num_{n}")]
        had = ", ".join(_count(getattr(recorded, f"num_{n}"), n) for n in differ)
        want = ", ".join(_count(getattr(topo, f"num_{n}"), n) for n in differ)
        raise ValueError(
            f"--previous {path}: the placement was planned for {had} but the flags give {want}; "
            f"re-plan with the topology in service ({', '.join('--' + n for n in differ)}) or plan afresh without --previous"
        )
    if prev.shape != (topo.num_layers, topo.num_slots):
        raise ValueError(
            f"{path}: the placement is {list(prev.shape)} (layers x slots) but the topology "
            f"needs [{topo.num_layers}, {topo.num_slots}]"
        )
    try:
        return eplb.Placement(prev, topo)
    except ValueError as exc:  # a bare .npy of floats or of experts the topology does not have
        raise ValueError(f"--previous {path}: not a placement of this topology: {exc}") from None


def _refuse_a_trace(path: str) -> None:
    """Raises the ``ValueError`` that says ``--previous path`` is a load trace, if it reads as one."""
    try:
        trace = eio.read_trace(path)
    except (ValueError, OSError):
        return
    raise ValueError(
        f"--previous {path}: this looks like a load trace ({trace.num_steps} steps x {trace.num_layers} layers x "
        f"{trace.num_experts} experts of counts), not a placement (layers x slots of expert ids); give it as TRACE, "
        "and the placement in service as --previous"
    )


# Without a terminal (a log, CI), progress is a plain line on stderr: the first once the plan
# has run this long, then at most one per interval, so a quick plan prints none.
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 3.0


def progress_lines(items: Sequence[T], prefix: str) -> Iterator[T]:
    """``items`` one at a time, with a line on stderr for a log file where a terminal gets a
    bar: ``eplb-bench: placement 12/42, 9 s``, the first after ``PROGRESS_AFTER_S``, then at
    most one per ``PROGRESS_EVERY_S``, and the last once all are done if any was printed."""
    start = time.monotonic()
    last = start + PROGRESS_AFTER_S - PROGRESS_EVERY_S
    for i, item in enumerate(items):
        now = time.monotonic()
        if i and now - last >= PROGRESS_EVERY_S:
            print(f"{prefix} {i}/{len(items)}, {now - start:.0f} s", file=sys.stderr, flush=True)
            last = now
        yield item
    if last > start + PROGRESS_AFTER_S - PROGRESS_EVERY_S:
        print(f"{prefix} {len(items)}/{len(items)}, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)


def _is_terminal() -> bool:
    return sys.stderr.isatty()


class ProgressLines:
    """``rebalance``'s progress callback as plain lines on stderr: ``eplb place: search: layers
    1200/20000 (6 %), 9 s``, after ``PROGRESS_AFTER_S`` (at once when ``eager``), at most one
    per ``PROGRESS_EVERY_S`` besides each phase's end; ``close`` adds the total time if a line
    was printed."""

    def __init__(self, eager: bool, prefix: str = "eplb place") -> None:
        self.prefix = prefix
        self.after = 0.0 if eager else PROGRESS_AFTER_S
        self.last: float | None = None
        self.elapsed = 0.0

    def __call__(self, p: eplb.Progress) -> None:
        self.elapsed = p.elapsed_s
        due = self.last is None or p.elapsed_s - self.last >= PROGRESS_EVERY_S
        # A phase's end shows too: a plan has few phases, and the last would often go unsaid.
        if p.elapsed_s < self.after or not (due or p.done_rows == p.total_rows):
            return
        self.last = p.elapsed_s
        pct = 100 * p.done_rows / p.total_rows if p.total_rows else 100.0
        print(
            f"{self.prefix}: {p.phase}: layers {p.done_rows}/{p.total_rows} ({pct:.0f} %), {p.elapsed_s:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.last is not None:
            print(f"{self.prefix}: planned in {self.elapsed:.0f} s", file=sys.stderr, flush=True)


class _ProgressBar:
    """``rebalance``'s progress callback as a tqdm bar on stderr (a terminal), one phase at a
    time; shown after half a second unless ``eager``, so a quick plan draws none."""

    def __init__(self, tqdm: Callable[..., object], desc: str, eager: bool) -> None:
        self.tqdm, self.desc, self.delay = tqdm, desc, 0.0 if eager else 0.5
        self.bar: object | None = None
        self.phase: str | None = None

    def __call__(self, p: eplb.Progress) -> None:
        if self.bar is None:
            self.bar = self.tqdm(
                total=p.total_rows, desc=f"{self.desc}: {p.phase}", unit="layer", file=sys.stderr, delay=self.delay
            )
        elif p.phase != self.phase or p.done_rows < self.bar.n:  # type: ignore[attr-defined]
            self.bar.reset(total=p.total_rows)  # type: ignore[attr-defined]
            self.bar.set_description(f"{self.desc}: {p.phase}", refresh=False)  # type: ignore[attr-defined]
        self.phase = p.phase
        self.bar.update(p.done_rows - self.bar.n)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()  # type: ignore[attr-defined]


@contextmanager
def _progress(desc: str, eager: bool) -> Iterator[Callable[[eplb.Progress], None]]:
    """Yields the ``progress=`` callback of ``rebalance``: a tqdm bar on a terminal (needs the
    bench extra), else plain lines (``ProgressLines``). It also re-raises a Ctrl-C that got
    lost (``_remember_ctrl_c``)."""
    show: ProgressLines | _ProgressBar = ProgressLines(eager)
    if _is_terminal():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            show = _ProgressBar(tqdm, desc, eager)
    with _remember_ctrl_c() as interrupted:

        def tick(p: eplb.Progress) -> None:
            if interrupted():
                raise KeyboardInterrupt
            show(p)

        try:
            yield tick
        finally:
            show.close()


@contextmanager
def _remember_ctrl_c() -> Iterator[Callable[[], bool]]:
    """Yields ``interrupted()``: whether Ctrl-C came. A Ctrl-C during a CP-SAT solve reaches
    Python only when the solve returns, inside protobuf code that swallows the
    KeyboardInterrupt, so the ilp run went on to the next layer; the progress callback asks
    this instead. Outside the main thread (where handlers cannot be set) it never reports."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit.is_set
        return

    def handler(signum: int, frame: object) -> None:
        hit.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


def _takes(policy: str, option: str) -> bool:
    return option in eplb.get_policy(policy).option_names()


# The order flags are named in: as --help lists them.
_FLAG_ORDER = (
    "tolerance",
    "layer_tolerance",
    "max_moves",
    "max_layer_moves",
    "effort",
    "work_budget",
    "time_limit",
    "workers",
)


def _time_flags(args: argparse.Namespace) -> dict:
    """``--kernel-curve``, ``--tokens-per-gpu``, ``--top-k``, ``--dispatch`` as ``rebalance``'s
    time options (``ValueError`` names the flag)."""
    from eplb import kernel

    if args.kernel_curve is None:
        given = [f for f in ("tokens_per_gpu", "top_k", "dispatch") if getattr(args, f) is not None]
        if given:
            raise ValueError(
                f"{', '.join('--' + f.replace('_', '-') for f in given)} plan for time: give --kernel-curve"
            )
        return {}
    if args.kernel_curve.endswith(".json"):
        import json

        try:
            raw = json.loads(Path(args.kernel_curve).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--kernel-curve {args.kernel_curve}: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(
                f"--kernel-curve {args.kernel_curve}: not a kernel model (eplb calibrate --out writes one)"
            )
        try:
            model = kernel.KernelModel.from_dict(raw)
        except ValueError as exc:
            raise ValueError(f"--kernel-curve {args.kernel_curve}: {exc}") from None
    else:
        try:
            model = kernel.load(args.kernel_curve)
        except ValueError as exc:
            raise ValueError(f"--kernel-curve: {exc}, or a .json from eplb calibrate --out") from None
    if not args.tokens_per_gpu:
        raise ValueError("--kernel-curve plans for batch sizes: give --tokens-per-gpu, e.g. 4,16,64")
    sizes: list = []
    for part in args.tokens_per_gpu.split(","):
        b, _, w = part.partition(":")
        try:
            sizes.append((int(b), float(w)) if w else int(b))
        except ValueError:
            raise ValueError(f"--tokens-per-gpu: {part!r} is not N or N:WEIGHT (e.g. 4,16,64 or 4:3,64:1)") from None
    return {
        "kernel_curve": model,
        "tokens_per_gpu": sizes,
        "top_k": 8 if args.top_k is None else args.top_k,
        "dispatch": args.dispatch or "even",
    }


def _planning(args: argparse.Namespace) -> dict:
    """The planning options of ``eplb place`` as ``rebalance`` options for ``args.policy``."""
    given = {
        "effort": args.effort,
        "work_budget": args.work_budget,
        "time_limit": args.time_limit,
        "workers": args.workers,
    }
    given = {k: v for k, v in given.items() if v is not None}
    # The re-plan bounds go to rebalance separately but are the policy's options too: checked
    # here so the error names the flag, not the library's option.
    bounds = [
        k for k in ("tolerance", "layer_tolerance", "max_moves", "max_layer_moves") if getattr(args, k) is not None
    ]
    # The registry says which policy takes which option.
    extra = sorted((k for k in [*given, *bounds] if not _takes(args.policy, k)), key=_FLAG_ORDER.index)
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        one = len(extra) == 1
        takers = [p for p in eplb.policies() if all(_takes(p, k) for k in extra)]
        raise ValueError(
            f"{flags} {'does' if one else 'do'} not apply to --policy {args.policy}; "
            + (
                f"{'it applies' if one else 'they apply'} to {', '.join(takers)}"
                if takers
                else "no policy takes them all"
            )
        )
    if args.policy == "ilp" and "time_limit" in given:
        # One limit over all layers; a layer may use all of what is left to it.
        given["total_time_limit"] = given["time_limit"]
    return given


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="eplb", description="Expert-parallel load balancer for MoE inference.")
    ap.add_argument("--version", action="version", version=f"eplb {eplb.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "place",
        help="plan a placement from a load trace (or a synthetic workload) and write it",
        description="Plan a placement from TRACE (formats: docs/tools.md) or, with --synthetic NAME instead, from a "
        "built-in workload, print a short report and write the placement.",
    )
    p.add_argument("trace", nargs="?", help="load trace file (.json .npy .npz .csv .pt)")
    p.add_argument("--trace-format", choices=eio.TRACE_FORMATS, help="trace format (default: by suffix)")
    p.add_argument(
        "--recorded-under",
        metavar="PLACEMENT",
        help="placement a vLLM window of physical counts was recorded under (any placement format or .npy phy2log)",
    )
    p.add_argument(
        "--synthetic",
        "--workload",
        dest="synthetic",
        choices=WORKLOADS,
        help="plan this built-in workload instead of a TRACE (docs/scales.md)",
    )
    p.add_argument(
        "--scale", choices=sorted(SCALES), help="standard topology (docs/scales.md) [v3-prefill with --synthetic]"
    )
    p.add_argument(
        "--topology", help="topology config file (.json or .toml: layers, experts, slots, gpus, nodes, groups)"
    )
    for name in _TOPO_ARGS:
        p.add_argument(
            f"--{name}",
            type=int,
            help=f"number of {name}" + (" (default: the trace's)" if name in ("layers", "experts") else ""),
        )
    window = p.add_mutually_exclusive_group()
    window.add_argument("--window", type=int, help="plan on the last N steps of a trace with a time axis")
    window.add_argument("--half-life", type=float, help="plan on an exponentially decayed sum (half-life in steps)")
    p.add_argument(
        "--policy", default="auto", choices=eplb.policies(), help="a registered policy (docs/algorithms.md) [auto]"
    )
    p.add_argument(
        "--kernel-curve",
        metavar="MODEL",
        help="plan for MoE time with this kernel model: a shipped name (eplb.kernel.shipped(), e.g. "
        "qwen3-30b-a3b@h100) or a model .json written by eplb calibrate --out (docs/algorithms.md)",
    )
    p.add_argument(
        "--tokens-per-gpu",
        metavar="LIST",
        help="with --kernel-curve: the batch sizes to plan for, tokens per gpu per step: 4,16,64 (equal weights) "
        "or 4:3,64:1 (size:weight)",
    )
    p.add_argument("--top-k", type=int, help="with --kernel-curve: experts each token picks [8]")
    p.add_argument(
        "--dispatch",
        choices=("even", "static"),
        help="with --kernel-curve: how the engine splits an expert's tokens over its replicas: even (vLLM) or "
        "static, one replica per source rank (SGLang) [even]",
    )
    p.add_argument(
        "--previous",
        metavar="PLACEMENT",
        help="the placement in service now (any placement format or .npy "
        "phy2log): re-plan migration-aware, moving as few slots as the bounds allow",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help="with --previous: mean imbalance over layers within (1 + this) x a fresh plan's [0.01]",
    )
    p.add_argument(
        "--layer-tolerance", type=float, help="with --previous: every layer within (1 + this) x fresh's [0.05]"
    )
    p.add_argument(
        "--max-moves", type=int, help="with --previous: at most this many slots rewritten in all (a hard limit)"
    )
    p.add_argument("--max-layer-moves", type=int, help="with --previous: at most this many slots rewritten per layer")
    p.add_argument(
        "--expert-bytes",
        type=float,
        help="with --previous: bytes of one expert's weights; prints the transfer plan's traffic",
    )
    p.add_argument(
        "--effort",
        choices=eplb.EFFORTS,
        help="fast: the first greedy plan; default: then search "
        "until within 0.1 %% of the bound or the work budget is spent; high: wider and longer [default]",
    )
    p.add_argument(
        "--work-budget",
        type=float,
        help="work units per layer for the search after the first plan (deterministic; default: the effort's)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        help="wall-clock seconds for the whole plan (cuts the search short; "
        "no limit by default; ilp: one limit over all layers)",
    )
    p.add_argument(
        "--workers", type=int, help="processes planning layers in parallel [1] (ilp: CP-SAT search threads [8])"
    )
    p.add_argument("--seed", type=int, help="seed of the synthetic workload [0]")
    p.add_argument(
        "--format",
        choices=eio.PLACEMENT_FORMATS,
        help="placement format (default: by --out suffix; .npy writes "
        "bare phy2log); without --out, native, sglang and listing print to stdout",
    )
    p.add_argument(
        "--out",
        help="write the placement here (.json native, .npz vllm, .txt listing, .npy phy2log; "
        "- for stdout, the report then going to stderr)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw a layer x gpu heatmap of gpu load / mean under the plan (beside --previous, moved "
        "slots marked) to FILE (.png, .svg or .pdf; needs the bench extra)",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr from the start of the plan (without it: a bar on a terminal after "
        "half a second, plain lines elsewhere after 3 s)",
    )
    p.set_defaults(fn=_place)
    s = sub.add_parser("serve", help="run the balancer service (eplb serve --help)", add_help=False)
    s.set_defaults(fn=None)
    a = sub.add_parser(
        "agent",
        help="a host's node agent: its ranks' reports summed into one per interval (eplb agent --help)",
        add_help=False,
    )
    a.set_defaults(fn=None)
    d = sub.add_parser(
        "demo",
        help="the service, simulated engine ranks and the weight mover on CPU (eplb demo --help)",
        add_help=False,
    )
    d.set_defaults(fn=None)
    c = sub.add_parser(
        "ctl",
        help="a running service: create, delete, list, show, placement, rebalance, watch, health (eplb ctl --help)",
        add_help=False,
    )
    c.set_defaults(fn=None)
    b = sub.add_parser(
        "bench",
        help="policies x workloads x scales as a report, as eplb-bench (eplb bench --help)",
        add_help=False,
    )
    b.set_defaults(fn=None)
    k = sub.add_parser(
        "calibrate",
        help="measure one gpu's MoE layer on this GPU and fit the kernel model (eplb calibrate --help)",
        add_help=False,
    )
    k.set_defaults(fn=None)
    return ap


def _subparser(ap: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (its usage in errors, not the top level's)."""
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return ap


def _unrecognized(parser: argparse.ArgumentParser, rest: list[str]) -> str:
    """argparse's "unrecognized arguments", with the flag meant where one is close (argparse
    suggests none before Python 3.14)."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in rest:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(rest)}" + (f" ({'; '.join(hints)})" if hints else "")


def _bench(argv: list[str]) -> int:
    """``eplb bench ARGS``: the installed ``eplb-bench`` command. Found by its entry point, not
    imported: the benchmarks build on the tools (eplb_bench imports eplb_tools), never the reverse."""
    from importlib.metadata import entry_points

    found = entry_points(group="console_scripts", name="eplb-bench")
    if not found:
        print("eplb bench: error: the eplb-bench command is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    return next(iter(found)).load()(argv)


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    # Plugin policies first, so that --policy offers them (eplb_service.plugins imports no grpc).
    from eplb_service import plugins

    try:
        plugins.load(plugins.parse(os.environ.get("EPLB_PLUGINS")))
    except ValueError as exc:
        print(f"eplb: error: EPLB_PLUGINS: {exc}", file=sys.stderr)
        return 2
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if args.command == "serve":
        # Imported here so `eplb place` works without the service extra installed.
        try:
            from eplb_service.cli import main as serve_main
        except ImportError as exc:
            print(f"eplb serve: error: {extras.missing('the service', 'service', exc)}", file=sys.stderr)
            return 2
        return serve_main(rest)
    if args.command == "agent":
        try:
            from eplb_engine.agent import main as agent_main
        except ImportError as exc:
            print(f"eplb agent: error: {extras.missing('the node agent', 'engine', exc)}", file=sys.stderr)
            return 2
        return agent_main(rest, parser_class=OneLineParser)
    if args.command == "demo":
        # The demo checks its extras (service, engine, torch) itself, after parsing its flags.
        from .demo import main as demo_main

        return demo_main(rest)
    if args.command == "ctl":
        from .ctl import main as ctl_main  # grpc only for ctl: it checks the service extra itself

        return ctl_main(rest)
    if args.command == "bench":
        return _bench(rest)
    if args.command == "calibrate":
        from .calibrate import main as calibrate_main  # torch only here

        return calibrate_main(rest)
    if rest:
        _subparser(ap, args.command).error(_unrecognized(_subparser(ap, args.command), rest))
    try:
        return args.fn(args)
    except BrokenPipeError:
        raise  # the reader of stdout went away: quiet_on_broken_pipe ends quietly
    except (ValueError, OSError) as exc:  # OSError: a file that cannot be read or written
        print(f"eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a plugin policy's own dependency (ilp's is checked up front)
        print(f"eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\neplb {args.command}: interrupted; nothing written", file=sys.stderr)
        return INTERRUPTED_STATUS


if __name__ == "__main__":
    sys.exit(main())

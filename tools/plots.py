"""PNG plots for ``eplb-bench --plots DIR``, ``eplb place --plot`` and ``eplb ctl placement
--plot`` (matplotlib, Agg backend: no display needed).

The report's charts are ``FIGSIZE`` inches at ``DPI``, saved without tight cropping so each
PNG is exactly ``PIXELS`` (width, height). The placement heatmap is sized by its layers and
gpus (``heatmap_size``) so that every cell stays visible.

The contiguous baseline ``none`` is often 3-8x imbalanced where every real policy is within a
few percent of 1.0: on one axis the policies would all sit on one flat line, so ``none`` gets
its own panel above the others. Lines that coincide (``global`` and ``auto`` often do) are
drawn widest first, each with its own dash pattern, so every one shows.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import TwoSlopeNorm  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

import eplb  # noqa: E402

from .plots_check import PLOT_SUFFIXES  # noqa: E402

__all__ = [
    "FIGSIZE",
    "DPI",
    "PIXELS",
    "PLOT_SUFFIXES",
    "BASELINE",
    "gpu_load_bars",
    "heatmap_size",
    "imbalance_per_layer",
    "imbalance_over_time",
    "placement_heatmap",
    "solve_time_by_scale",
]

FIGSIZE = (10.0, 5.0)
DPI = 100
PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
# The contiguous placement, plotted on its own axis.
BASELINE = "none"
# Room right of the axes for the legend, so it never covers a bar or a line.
_LEGEND_RIGHT = 0.82
_DASHES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1))]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _colors(names: list[str]) -> dict[str, str]:
    """One colour per name, the same in every chart of a run (the default cycle, in order)."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def _lines(ax: Axes, x: np.ndarray, series: dict[str, np.ndarray], colors: dict[str, str]) -> None:
    """Lines that may coincide: the first drawn widest and each with its own dashes and
    marker, so a line under another still shows at its edges."""
    n = len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.plot(
            x,
            values,
            color=colors[name],
            linestyle=_DASHES[i % len(_DASHES)],
            linewidth=1.2 + 1.6 * (n - 1 - i) / max(n - 1, 1),
            marker=_MARKERS[i % len(_MARKERS)] if len(x) <= 64 else None,
            # Filled, smaller on top: a marker under another shows as a ring around it.
            markersize=3 + 4 * (n - 1 - i) / max(n - 1, 1),
            label=name,
            zorder=2 + i,
        )


def _legend_outside(fig: Figure, axes: list[Axes]) -> None:
    handles, labels = [], []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.subplots_adjust(right=_LEGEND_RIGHT)
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(_LEGEND_RIGHT + 0.01, 0.88), fontsize="small")


def _split_baseline(series: dict[str, np.ndarray]) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    return series.get(BASELINE), {k: v for k, v in series.items() if k != BASELINE}


def gpu_load_bars(path: Path, loads_by_policy: dict[str, np.ndarray], title: str) -> Path:
    """``loads_by_policy``: name → ``[G]`` gpu load of one layer. Bars of load / mean (1.0 is
    balanced): ``none`` in its own panel above, the policies grouped below on their scale."""
    colors = _colors(list(loads_by_policy))
    baseline, policies = _split_baseline(loads_by_policy)
    ref = next(iter(loads_by_policy.values()))
    mean = float(np.mean(ref)) or 1.0
    num_gpus = len(ref)
    x = np.arange(num_gpus)
    if baseline is not None and policies:
        fig, (top, ax) = plt.subplots(2, 1, figsize=FIGSIZE, sharex=True, height_ratios=(1, 2))
        top.bar(x, baseline / mean, 0.8, color=colors[BASELINE], label=f"{BASELINE} (contiguous)")
        top.axhline(1.0, color="black", linestyle="--", linewidth=1)
        top.set(ylabel="load / mean", title=title)
    else:
        fig, ax = plt.subplots(figsize=FIGSIZE)
        top = None
        ax.set_title(title)
        policies = policies or loads_by_policy
    width = 0.8 / max(len(policies), 1)
    for i, (name, values) in enumerate(policies.items()):
        ax.bar(x + i * width - 0.4 + width / 2, values / mean, width, color=colors[name], label=name)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="mean")
    low = min(float(np.min(v)) for v in policies.values()) / mean
    ax.set_ylim(max(0.0, min(0.9, low - 0.05)), None)
    ax.set(xlabel=f"gpu (mean load {mean:.4g} tokens)", ylabel="load / mean")
    ax.set_xlim(-0.6, num_gpus - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend_outside(fig, [a for a in (top, ax) if a is not None])
    return _save(fig, path)


def imbalance_per_layer(
    path: Path, imbalance_by_policy: dict[str, np.ndarray], lower_bound: np.ndarray, title: str
) -> Path | None:
    """``imbalance_by_policy``: name → ``[L]`` max/mean gpu load; ``lower_bound``: ``[L]``.
    None (nothing written) for one layer: a line of one point says nothing the table does not."""
    if len(lower_bound) < 2:
        return None
    colors = _colors(list(imbalance_by_policy))
    baseline, policies = _split_baseline(imbalance_by_policy)
    layers = np.arange(len(lower_bound))
    if baseline is not None and policies:
        fig, (top, ax) = plt.subplots(2, 1, figsize=FIGSIZE, sharex=True, height_ratios=(1, 2.5))
        top.plot(layers, baseline, color=colors[BASELINE], marker=".", label=f"{BASELINE} (contiguous)")
        top.set(ylabel="imbalance", title=title)
    else:
        fig, ax = plt.subplots(figsize=FIGSIZE)
        top = None
        ax.set_title(title)
        policies = policies or imbalance_by_policy
    _lines(ax, layers, policies, colors)
    ax.plot(layers, lower_bound, color="black", linestyle="--", linewidth=1, label="lower bound", zorder=10)
    ax.set(xlabel="layer", ylabel="imbalance (max / mean gpu load)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend_outside(fig, [a for a in (top, ax) if a is not None])
    return _save(fig, path)


def imbalance_over_time(
    path: Path,
    imbalance_by_policy: dict[str, np.ndarray],
    moves_by_policy: dict[str, np.ndarray],
    replan_steps: np.ndarray,
    title: str,
) -> Path:
    """``imbalance_by_policy``: name → ``[T]`` mean-over-layers imbalance per step;
    ``moves_by_policy``: name → ``[R]`` slots moved at each re-plan (steps ``replan_steps``).
    ``none`` on its own axis; slots moved on a log scale (``deepseek`` moves ~10x the others)."""
    colors = _colors(list(imbalance_by_policy))
    baseline, policies = _split_baseline(imbalance_by_policy)
    rows = (1, 2, 1.3) if baseline is not None and policies else (2, 1.3)
    fig, axes = plt.subplots(len(rows), 1, figsize=FIGSIZE, sharex=True, height_ratios=rows)
    if len(rows) == 3:
        top, mid, bottom = axes
        top.plot(np.arange(len(baseline)), baseline, color=colors[BASELINE], label=f"{BASELINE} (contiguous)")
        top.set(ylabel="imbalance", title=title)
        panels = (top, mid)
    else:
        mid, bottom = axes
        mid.set_title(title)
        policies = policies or imbalance_by_policy
        panels = (mid,)
    _lines(mid, np.arange(len(next(iter(policies.values())))), policies, colors)
    mid.set(ylabel="imbalance")
    for ax in panels:
        for step in replan_steps:
            ax.axvline(step, color="grey", linewidth=0.5)
    moved = {k: v for k, v in moves_by_policy.items() if k != BASELINE}
    width = 0.8 / max(len(moved), 1)
    for i, (name, values) in enumerate(moved.items()):
        bottom.bar(replan_steps + i * width - 0.4 + width / 2, np.maximum(values, 0), width, color=colors.get(name))
    if any(np.any(np.asarray(v) > 0) for v in moved.values()):
        bottom.set_yscale("log")
    bottom.set(xlabel="step", ylabel="slots moved")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    _legend_outside(fig, list(panels))
    return _save(fig, path)


def solve_time_by_scale(path: Path, seconds: dict[str, dict[str, float]], median_of: int = 1) -> Path:
    """``seconds``: policy → scale → seconds per full-model plan, the median over up to
    ``median_of`` workloads of the scale (the title says so when that is more than one);
    grouped bars, log scale."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    scales = sorted({s for by_scale in seconds.values() for s in by_scale})
    width = 0.8 / max(len(seconds), 1)
    x = np.arange(len(scales))
    for i, (name, by_scale) in enumerate(seconds.items()):
        values = [by_scale.get(s, np.nan) * 1e3 for s in scales]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    ax.set_xticks(x, scales)
    ax.set_yscale("log")
    ax.set(
        ylabel="solve ms per full-model plan",
        title="solve time by scale" + (f" (median over {median_of} workloads)" if median_of > 1 else ""),
    )
    _legend_outside(fig, [ax])
    return _save(fig, path)


def heatmap_size(num_layers: int, num_gpus: int, panels: int) -> tuple[float, float]:
    """Figure inches for ``panels`` layer x gpu heatmaps side by side: about 6 px per gpu and
    7 px per layer at ``DPI`` (58 x 32 and 94 x 128 both readable), within 4.5-10 in a panel."""
    width = float(np.clip(num_gpus * 0.06, 4.5, 10.0)) * panels + 1.2
    height = float(np.clip(num_layers * 0.07, 3.0, 10.0)) + 1.4
    return width, height


def placement_heatmap(
    path: Path,
    loads: np.ndarray,
    placement: eplb.Placement,
    previous: eplb.Placement | None = None,
    title: str = "",
    label: str = "plan",
    previous_label: str = "previous",
    mark_moves: bool = True,
) -> Path:
    """``loads``: ``[L, E]``. A layer x gpu heatmap of each gpu's load / the layer's mean under
    ``placement`` (1.0 balanced, red hotter, blue cooler), beside ``previous`` when given, on one
    colour scale. With ``mark_moves``, dots mark the (layer, gpu) cells whose slots changed
    expert since ``previous``, sized by how many did."""
    topo = placement.topology
    shown = [(previous_label, previous), (label, placement)] if previous is not None else [(label, placement)]
    ratios = []
    for _, p in shown:
        g = eplb.gpu_loads(loads, p)
        mean = g.mean(axis=1, keepdims=True)
        ratios.append(np.divide(g, mean, out=np.ones_like(g), where=mean > 0))
    vmax = max(1.05, max(float(r.max()) for r in ratios))
    vmin = min(0.95, min(float(r.min()) for r in ratios))
    norm = TwoSlopeNorm(vmin=vmin, vcenter=1.0, vmax=vmax)
    fig, axes = plt.subplots(
        1,
        len(shown),
        figsize=heatmap_size(topo.num_layers, topo.num_gpus, len(shown)),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    image = None
    for ax, (name, p), r in zip(axes[0], shown, ratios):
        image = ax.imshow(r, aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest", origin="upper")
        imb = eplb.imbalance(eplb.gpu_loads(loads, p))
        ax.set_title(f"{name}: imbalance mean {imb.mean():.4f}, worst {imb.max():.4f}", fontsize="medium")
        ax.set_xlabel("gpu")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel("layer")
    caption = ""
    if previous is not None and mark_moves:
        # Slots whose expert changed, counted per (layer, gpu) cell.
        changed = previous.phy2log != placement.phy2log  # [L, P]
        per_gpu = changed.reshape(topo.num_layers, topo.num_gpus, topo.slots_per_gpu).sum(axis=2)
        layer, gpu = np.nonzero(per_gpu)
        if layer.size:
            top = per_gpu.max()
            # Small filled dots: the cell's colour still shows around them on 94 x 128.
            axes[0][-1].scatter(gpu, layer, s=1.5 + 6 * per_gpu[layer, gpu] / top, c="black", marker="o", linewidths=0)
        moved = int(changed.sum())
        caption = (
            f"{moved} of {changed.size} slots moved; dots: a gpu whose slots changed "
            f"(larger: more, up to {per_gpu.max()} in one layer)"
        )
    cbar = fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03, pad=0.01, aspect=30)
    cbar.set_label("gpu load / layer mean")
    heading = title or f"{topo.num_layers} layers x {topo.num_gpus} gpus"
    fig.suptitle(heading + (f"\n{caption}" if caption else ""))
    return _save(fig, path)

"""PNG plots for ``eplb-bench --plots DIR`` (matplotlib, Agg backend: no display needed).

Every figure is ``FIGSIZE`` inches at ``DPI``, saved without tight cropping so each PNG is
exactly ``PIXELS`` (width, height).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

__all__ = [
    "FIGSIZE",
    "DPI",
    "PIXELS",
    "gpu_load_bars",
    "imbalance_per_layer",
    "imbalance_over_time",
    "solve_time_by_scale",
]

FIGSIZE = (10.0, 5.0)
DPI = 100
PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def gpu_load_bars(path: Path, loads_by_policy: dict[str, np.ndarray], title: str) -> Path:
    """``loads_by_policy``: name → ``[G]`` gpu load of one layer; grouped bars, mean as a line."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    names = list(loads_by_policy)
    num_gpus = len(next(iter(loads_by_policy.values())))
    width = 0.8 / len(names)
    x = np.arange(num_gpus)
    for i, name in enumerate(names):
        ax.bar(x + i * width - 0.4 + width / 2, loads_by_policy[name], width, label=name)
    ax.axhline(
        float(np.mean(next(iter(loads_by_policy.values())))), color="black", linestyle="--", linewidth=1, label="mean"
    )
    ax.set(xlabel="gpu", ylabel="tokens", title=title)
    ax.legend(fontsize="small", ncols=min(len(names) + 1, 6))
    return _save(fig, path)


def imbalance_per_layer(
    path: Path, imbalance_by_policy: dict[str, np.ndarray], lower_bound: np.ndarray, title: str
) -> Path:
    """``imbalance_by_policy``: name → ``[L]`` max/mean gpu load; ``lower_bound``: ``[L]``."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    layers = np.arange(len(lower_bound))
    for name, values in imbalance_by_policy.items():
        ax.plot(layers, values, marker=".", label=name)
    ax.plot(layers, lower_bound, color="black", linestyle="--", label="lower bound")
    ax.set(xlabel="layer", ylabel="imbalance (max / mean gpu load)", title=title)
    ax.legend(fontsize="small")
    return _save(fig, path)


def imbalance_over_time(
    path: Path,
    imbalance_by_policy: dict[str, np.ndarray],
    moves_by_policy: dict[str, np.ndarray],
    replan_steps: np.ndarray,
    title: str,
) -> Path:
    """``imbalance_by_policy``: name → ``[T]`` mean-over-layers imbalance per step;
    ``moves_by_policy``: name → ``[R]`` slots moved at each re-plan (steps ``replan_steps``)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=FIGSIZE, sharex=True, height_ratios=(2, 1))
    for name, values in imbalance_by_policy.items():
        top.plot(np.arange(len(values)), values, label=name)
    for step in replan_steps:
        top.axvline(step, color="grey", linewidth=0.5)
    top.set(ylabel="imbalance", title=title)
    top.legend(fontsize="small")
    names = list(moves_by_policy)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        bottom.bar(replan_steps + i * width - 0.4 + width / 2, moves_by_policy[name], width, label=name)
    bottom.set(xlabel="step", ylabel="slots moved")
    return _save(fig, path)


def solve_time_by_scale(path: Path, seconds: dict[str, dict[str, float]]) -> Path:
    """``seconds``: policy → scale → seconds per full-model plan; grouped bars, log scale."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    scales = sorted({s for by_scale in seconds.values() for s in by_scale})
    width = 0.8 / max(len(seconds), 1)
    x = np.arange(len(scales))
    for i, (name, by_scale) in enumerate(seconds.items()):
        values = [by_scale.get(s, np.nan) * 1e3 for s in scales]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
    ax.set_xticks(x, scales)
    ax.set_yscale("log")
    ax.set(ylabel="solve ms per full-model plan", title="solve time by scale")
    ax.legend(fontsize="small")
    return _save(fig, path)

"""The plots: the placement heatmap (eplb place --plot, eplb-bench --plots) and the report's
charts, checked on the figures matplotlib draws (captured before they are saved)."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

import eplb
from eplb.workloads import SCALES, drift, make_loads
from eplb_tools import cli, plots


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every figure the plots save, kept open for the test to read."""
    kept: list = []
    save = plots._save

    def keep(fig, path: Path) -> Path:
        kept.append(fig)
        fig.savefig(path, dpi=plots.DPI)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    yield kept
    import matplotlib.pyplot as plt

    for fig in kept:
        plt.close(fig)
    assert save is not keep


@pytest.mark.parametrize(
    "topo",
    [SCALES["v3-prefill"], eplb.Topology(94, 128, 256, 128, 16, 1)],
    ids=["58x32", "94x128"],
)
def test_heatmap_is_readable_and_marks_each_moved_cell(tmp_path: Path, figures: list, topo: eplb.Topology) -> None:
    seq = drift(make_loads("zipf-1.0", topo), 0.1, 2)
    previous = eplb.rebalance(seq[0], topo, "global", effort="fast").placement
    plan = eplb.rebalance(seq[1], topo, "global", previous=previous, effort="fast").placement
    path = plots.placement_heatmap(tmp_path / "h.png", seq[1], plan, previous, title="t")
    img = mpimg.imread(path)
    (fig,) = figures
    left, right = fig.axes[0], fig.axes[1]
    # Each heatmap cell at least 5 px wide and 5 px tall in the PNG, for 58 x 32 and 94 x 128.
    bbox = right.get_window_extent()
    assert bbox.width / topo.num_gpus >= 5 and bbox.height / topo.num_layers >= 5
    assert img.shape[1] <= 2000  # and the whole fits a screen's width
    # Both panels on one colour scale, centred on 1.0 (balanced).
    assert left.images[0].norm is right.images[0].norm and right.images[0].norm.vcenter == 1.0
    ratio = eplb.gpu_loads(seq[1], plan) / eplb.gpu_loads(seq[1], plan).mean(axis=1, keepdims=True)
    assert np.allclose(right.images[0].get_array(), ratio)
    # One dot per (layer, gpu) cell whose slots changed expert, none elsewhere.
    changed = (previous.phy2log != plan.phy2log).reshape(topo.num_layers, topo.num_gpus, -1).any(axis=2)
    dots = right.collections[0].get_offsets()
    assert {(int(y), int(x)) for x, y in dots} == set(zip(*np.nonzero(changed)))
    assert (
        f"{int((previous.phy2log != plan.phy2log).sum())} of {plan.phy2log.size} slots moved"
        in fig._suptitle.get_text()
    )
    assert all(float(t).is_integer() for t in right.get_xticks())


def test_place_plot_writes_the_heatmap_beside_previous(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first = tmp_path / "p.json"
    assert cli.main(["place", "--synthetic", "zipf-1.0", "--scale", "v3-prefill", "--out", str(first)]) == 0
    png = tmp_path / "h.png"
    argv = [
        "place",
        "--synthetic",
        "lognormal-1.0",
        "--scale",
        "v3-prefill",
        "--previous",
        str(first),
        "--plot",
        str(png),
    ]
    assert cli.main(argv) == 0
    assert f"wrote plot to {png}" in capsys.readouterr().out
    with png.open("rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert mpimg.imread(png).shape[1] > 900


@pytest.mark.parametrize(
    ("plot", "said"),
    [
        ("{tmp}/h.jpg", "--plot {tmp}/h.jpg: give a file ending in .png, .svg, .pdf"),
        ("{tmp}/nope/h.png", "--plot {tmp}/nope/h.png: directory {tmp}/nope does not exist"),
        ("{tmp}", "--plot {tmp}: is a directory; give a file name such as {tmp}/placement.png"),
    ],
)
def test_place_plot_refuses_a_path_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture, plot: str, said: str
) -> None:
    argv = ["place", "--synthetic", "zipf-1.0", "--scale", "v3-prefill", "--plot", plot.format(tmp=tmp_path)]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert err == f"eplb place: error: {said.format(tmp=tmp_path)}\n" and "imbalance" not in out


def test_place_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    argv = ["place", "--synthetic", "zipf-1.0", "--scale", "small", "--plot", str(tmp_path / "h.png")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "eplb place: error: --plot needs the bench extra (missing: matplotlib); install it with: pip install 'eplb[bench]'\n"
    )
    assert not (tmp_path / "h.png").exists()


def _report_series(topo: eplb.Topology) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    loads = make_loads("zipf-1.0", topo)
    out = {"none": eplb.imbalance(eplb.gpu_loads(loads, eplb.Placement.contiguous(topo)))}
    for p in ("deepseek", "global", "auto"):
        out[p] = eplb.imbalance(eplb.gpu_loads(loads, eplb.rebalance(loads, topo, p).placement))
    return loads, out


def test_per_layer_chart_gives_none_its_own_axis_and_keeps_lines_apart(tmp_path: Path, figures: list) -> None:
    topo = SCALES["v3-prefill"]
    loads, series = _report_series(topo)
    assert series["none"].mean() > 3  # the case the chart is for: none far above the rest
    plots.imbalance_per_layer(tmp_path / "a.png", series, eplb.imbalance_lb(loads, topo), "t")
    (fig,) = figures
    top, ax = fig.axes
    assert [line.get_label() for line in top.get_lines()] == ["none (contiguous)"]
    # The policies' axis is on their scale, not none's: its top is below none's smallest layer.
    assert ax.get_ylim()[1] < series["none"].min()
    lines = {line.get_label(): line for line in ax.get_lines()}
    # global and auto coincide here: one is drawn wider, with other dashes, so both show.
    assert np.allclose(lines["global"].get_ydata(), lines["auto"].get_ydata(), atol=1e-3)
    assert lines["global"].get_linewidth() > lines["auto"].get_linewidth()
    assert lines["global"].get_linestyle() != lines["auto"].get_linestyle()
    # The legend is right of every axis, on no line.
    legend = fig.legends[0].get_window_extent()
    assert all(legend.x0 >= a.get_window_extent().x1 for a in fig.axes)
    assert mpimg.imread(tmp_path / "a.png").shape[:2] == (plots.PIXELS[1], plots.PIXELS[0])


def test_per_layer_chart_is_left_out_for_one_layer(tmp_path: Path) -> None:
    assert plots.imbalance_per_layer(tmp_path / "a.png", {"global": np.ones(1)}, np.ones(1), "t") is None
    assert not (tmp_path / "a.png").exists()


def test_gpu_bars_integer_ticks_legend_off_the_bars(tmp_path: Path, figures: list) -> None:
    topo = SCALES["small"]
    loads = make_loads("zipf-1.0", topo)
    bars = {
        p: eplb.gpu_loads(loads, eplb.rebalance(loads, topo, p).placement)[0]
        for p in ("deepseek", "global", "hierarchical")
    }
    bars = {"none": eplb.gpu_loads(loads, eplb.Placement.contiguous(topo))[0], **bars}
    plots.gpu_load_bars(tmp_path / "b.png", bars, "t")
    (fig,) = figures
    top, ax = fig.axes
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert ax.get_ylim()[1] < (bars["none"] / bars["none"].mean()).max()
    legend = fig.legends[0].get_window_extent()
    assert all(legend.x0 >= a.get_window_extent().x1 for a in fig.axes)


def test_solve_time_says_median_over_workloads_only_when_it_is_one(tmp_path: Path, figures: list) -> None:
    plots.solve_time_by_scale(tmp_path / "a.png", {"global": {"small": 0.01}}, median_of=3)
    plots.solve_time_by_scale(tmp_path / "b.png", {"global": {"small": 0.01}}, median_of=1)
    assert figures[0].axes[0].get_title() == "solve time by scale (median over 3 workloads)"
    assert figures[1].axes[0].get_title() == "solve time by scale"


def test_over_time_puts_none_apart_and_moves_on_a_log_scale(tmp_path: Path, figures: list) -> None:
    steps = np.array([4, 8])
    plots.imbalance_over_time(
        tmp_path / "a.png",
        {"none": np.full(12, 2.4), "deepseek": np.full(12, 1.1), "global": np.full(12, 1.05)},
        {"none": np.zeros(2), "deepseek": np.array([14000, 15000]), "global": np.array([800, 1200])},
        steps,
        "t",
    )
    (fig,) = figures
    top, mid, bottom = fig.axes
    labels = lambda ax: {line.get_label() for line in ax.get_lines()} - {f"_child{i}" for i in range(9)}
    assert labels(top) == {"none (contiguous)"} and labels(mid) == {"deepseek", "global"}
    assert bottom.get_yscale() == "log" and len(bottom.patches) == 4  # none's zero moves not drawn


def test_bench_plots_include_the_heatmap_of_a_multi_layer_case(tmp_path: Path) -> None:
    from eplb_bench import report

    settings = report.Settings(
        scales=("v3-prefill",),
        workloads=("zipf-1.0",),
        policies=("global",),
        replan_scales=(),
        replan_steps=4,
        replan_every=2,
        step_scales=(),
        tokens_per_gpu=(8,),
        sim_steps=5,
        topk=2,
        layer=0,
        ilp_time_limit=1.0,
    )
    names = sorted(Path(p).name for p in report.build_report(settings, plots=tmp_path)["plots"])
    assert names == [
        "gpu_load_v3-prefill_zipf-1.0_layer0.png",
        "imbalance_per_layer_v3-prefill_zipf-1.0.png",
        "placement_v3-prefill_zipf-1.0_global.png",
        "solve_time_by_scale.png",
    ]
    assert mpimg.imread(tmp_path / "placement_v3-prefill_zipf-1.0_global.png").shape[:2] == (546, 1020)

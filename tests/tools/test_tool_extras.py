"""A tool run without the extra it needs prints one line naming the pip extra (and the real
package missing, not its import name) and exits 2, with no traceback. The missing package is
simulated in a fresh interpreter by ``sys.modules[name] = None`` (what import sees then)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _without(modules: list[str], entry: str, argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    code = (
        f"import sys\nfor m in {modules!r}: sys.modules[m] = None\nfrom {entry} import main\nsys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("module", "package"),
    [("redis", "redis"), ("torch", "torch"), ("google", "protobuf"), ("grpc", "grpcio")],
)
def test_demo_without_its_extra(module: str, package: str) -> None:
    line = _one_line(_without([module], "eplb_tools.cli", ["demo", "--seconds", "1"]))
    assert line == (
        f"eplb demo: error: the demo needs the demo extra (missing: {package}); install it with: pip install 'eplb[demo]'"
    )


def test_serve_names_the_package_not_the_namespace() -> None:
    line = _one_line(_without(["google"], "eplb_tools.cli", ["serve"]))
    assert line == (
        "eplb serve: error: the service needs the service extra (missing: protobuf); "
        "install it with: pip install 'eplb[service]'"
    )


def test_place_ilp_without_ortools() -> None:
    flags = ["place", "--synthetic", "zipf-1.0", "--scale", "small", "--policy", "ilp"]
    line = _one_line(_without(["ortools"], "eplb_tools.cli", flags))
    assert line == (
        "eplb place: error: --policy ilp needs the ilp extra (missing: ortools); install it with: pip install 'eplb[ilp]'"
    )


def test_ilp_policy_error_is_not_chained() -> None:
    # A library user sees one ImportError (naming the module), not "No module named" above it.
    code = (
        "import sys; sys.modules['ortools'] = None\n"
        "import eplb\nfrom eplb.workloads import SCALES, make_loads\n"
        "t = SCALES['small']\n"
        "try:\n    eplb.rebalance(make_loads('zipf-1.0', t), t, 'ilp')\n"
        "except ImportError as e:\n    print(e.name, e.__cause__, e.__suppress_context__)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.stdout.strip() == "ortools None True", r.stderr


def test_bench_without_tqdm_runs(tmp_path: Path) -> None:
    flags = ["--scales", "small", "--workloads", "zipf-1.0", "--policies", "global"]
    r = _without(["tqdm"], "eplb_bench.report", flags)
    assert r.returncode == 0, r.stderr
    assert "## placement" in r.stdout


def test_bench_plots_without_matplotlib(tmp_path: Path) -> None:
    r = _without(["matplotlib"], "eplb_bench.report", ["--quick", "--plots", str(tmp_path / "plots")])
    assert _one_line(r) == (
        "eplb-bench: error: --plots needs the bench extra (missing: matplotlib); "
        "install it with: pip install 'eplb[bench]'"
    )

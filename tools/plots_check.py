"""What ``--plot FILE`` may be, checked before any work and importable without matplotlib
(``tools/plots.py`` needs it): the suffixes matplotlib writes, and ``plot_target``, the check
``eplb place --plot`` and ``eplb ctl placement --plot`` share."""

from __future__ import annotations

from pathlib import Path

from . import extras

__all__ = ["PLOT_SUFFIXES", "plot_target"]

# matplotlib writes by the suffix.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def plot_target(flag: str, value: str) -> Path:
    """Where ``flag`` (``--plot FILE``) writes its heatmap, checked before any work: matplotlib
    there (the bench extra), a suffix it writes, a directory that exists."""
    try:
        extras.require("matplotlib")
    except ImportError as exc:
        raise ValueError(extras.missing(flag, "bench", exc)) from None
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{flag} {value}: is a directory; give a file name such as {path / 'placement.png'}")
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"{flag} {value}: give a file ending in {', '.join(PLOT_SUFFIXES)}")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {value}: directory {path.parent} does not exist")
    return path

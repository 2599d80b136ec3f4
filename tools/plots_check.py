"""What ``--plot FILE`` may end in, importable without matplotlib (``tools/plots.py`` needs it)."""

from __future__ import annotations

__all__ = ["PLOT_SUFFIXES"]

# matplotlib writes by the suffix.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")

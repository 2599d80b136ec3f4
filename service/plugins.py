"""Policies from outside eplb: plugin modules, loaded in the server and in every planning worker.

A plugin is a module whose import registers policies with ``eplb.register_policy``. Two ways
name one:
- an installed package's entry point in the group ``eplb.policies``
  (``[project.entry-points."eplb.policies"] mine = "my_pkg.policies"``), loaded everywhere
  eplb plans by name (``eplb serve``, ``eplb place``, ``eplb-bench``, the service's workers);
- ``eplb serve --plugins my_pkg.policies,other`` / ``EPLB_PLUGINS`` (``eplb place`` and
  ``eplb-bench`` read ``EPLB_PLUGINS``), for modules that are importable but not packaged.

Only imports happen here (no grpc), so the tools can load plugins without the service extra.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.metadata import entry_points

import eplb

__all__ = ["ENTRY_POINT_GROUP", "load", "parse"]

ENTRY_POINT_GROUP = "eplb.policies"

# What this process has imported already (module names and "name=value" of entry points):
# a planning worker loads the same plugins for every job.
_done: set[str] = set()


def parse(text: str | None) -> tuple[str, ...]:
    """``"a.b, c"`` → ``("a.b", "c")``: module names, comma separated (empty or None: none)."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def load(modules: Sequence[str] = ()) -> tuple[str, ...]:
    """Import each of ``modules`` and every ``eplb.policies`` entry point, once per process →
    the names of the policies they registered now. A plugin that fails to import (or registers
    a name already taken) raises ``ValueError`` naming it; what loaded before it stays."""
    before = set(eplb.policies())
    for name in modules:
        if name not in _done:
            try:
                importlib.import_module(name)
            except Exception as exc:  # any error in someone else's module: name the plugin
                raise ValueError(f"plugin {name!r} failed to load: {type(exc).__name__}: {exc}") from None
            _done.add(name)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ep.name}={ep.value}"
        if key not in _done:
            try:
                ep.load()
            except Exception as exc:
                raise ValueError(
                    f"plugin entry point {ep.name!r} ({ep.value}) in group {ENTRY_POINT_GROUP!r} failed to load: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
            _done.add(key)
    return tuple(sorted(set(eplb.policies()) - before))

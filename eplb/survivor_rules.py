"""The rules of a survivor plan, shared by the service and the engine ranks.

When gpus go down the service plans a survivor placement (``SetRanksDown``) and each live
engine rank may compute the same one by itself while the service is unreachable. Both sides
call ``eplb.rebalance(loads [L, E], topology, SURVIVOR_POLICY, previous=base, down_gpus=...,
**SURVIVOR_OPTIONS)``; the plans are deterministic (a work budget, no time limit), so they agree
as long as both run the same eplb release, which every planned placement records
(``EPLB_VERSION``). One definition here, imported by both, so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from types import MappingProxyType

__all__ = ["EPLB_VERSION", "SURVIVOR_OPTIONS", "SURVIVOR_POLICY", "eplb_version"]

SURVIVOR_POLICY = "auto"
# Read-only: both sides share this one object, so a caller's edit cannot split them.
SURVIVOR_OPTIONS: Mapping[str, object] = MappingProxyType({"effort": "fast"})


def eplb_version() -> str:
    """The installed eplb release (package metadata; an editable install has it too), else
    ``"0+unknown"``: a checkout on ``sys.path`` that was never installed. A valid PEP 440 version,
    so tools that parse ``eplb.__version__`` still can."""
    try:
        return version("eplb")
    except PackageNotFoundError:
        return "0+unknown"


# Recorded in every planned placement (Placement.eplb_version) and compared by the ranks.
EPLB_VERSION = eplb_version()

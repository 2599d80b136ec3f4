"""eplb_engine: what an inference engine runs to use the balancer.

``BalancedRank`` is the one object an engine rank needs: it wires the parts below. The
client half (load reporting, placement watching, wire helpers) needs only grpcio and numpy;
``BalancedRank``, the weight mover and the engine adapters need torch. Torch-backed names are
resolved on first access, so ``import eplb_engine`` works on a machine without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule that defines it; imported on first attribute access (PEP 562), so the
# torch-free client names never pull in torch. Add an entry per public name.
_LAZY: dict[str, str] = {
    "BalancedRank": "balanced_rank",
    "Draft": "balanced_rank",
    "WeightMover": "mover",
    "MoveReport": "mover",
    "DistTransport": "transport",
    "P2P": "transport",
    "ServiceClient": "client",
    "Endpoints": "client",
    "LoadReporter": "reporter",
    "ReporterStats": "reporter",
    "PlacementWatcher": "watcher",
    "PublishedPlacement": "wire",
    "Rollout": "rollout",
    "MoverApplier": "rollout",
    "AsyncServiceClient": "aio",
    "ServiceBarrier": "rollout",
    "ProcessGroupBarrier": "rollout",
    "RolloutGroup": "rollout",
    "AckSender": "rollout",
    "survivor_plan": "survivors",
    "same_survivor": "survivors",
    "EpochGroups": "membership",
    "JoinWord": "membership",
    "mark_down": "membership",
    "read_down": "membership",
    "detect_down": "membership",
    "epoch_groups": "membership",
    "mark_ready": "membership",
    "placeholder_world": "membership",
    "joiner_ready": "membership",
    "announce_join": "membership",
    "wait_join": "membership",
    "cancel_join": "membership",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'eplb_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

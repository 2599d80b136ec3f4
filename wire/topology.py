"""``Topology`` messages ↔ ``eplb.Topology``: the one topology codec of both sides.

On the wire 0 nodes or groups mean 1. Decoding refuses a count of 0 and, with ``limits``, the
documented limits (``eplb.limits``: counts, placement and window sizes; the service's, checked
before any state is written), then ``eplb.Topology``'s own rules, as a :class:`WireError` naming
the field path.
"""

from __future__ import annotations

import eplb
from eplb import limits as _limits

from ._gen.eplb.v1 import balancer_pb2 as pb
from .errors import WireError

__all__ = ["topology_from_pb", "topology_to_pb"]

_COUNTS = ("num_layers", "num_experts", "num_slots", "num_gpus")


def topology_to_pb(topo: eplb.Topology) -> pb.Topology:
    """``eplb.Topology`` → its ``Topology`` message of the wire (every count set)."""
    return pb.Topology(
        num_layers=topo.num_layers,
        num_experts=topo.num_experts,
        num_slots=topo.num_slots,
        num_gpus=topo.num_gpus,
        num_nodes=topo.num_nodes,
        num_groups=topo.num_groups,
    )


def topology_from_pb(msg: pb.Topology, field: str = "topology", limits: bool = False) -> eplb.Topology:
    """``Topology`` message → ``eplb.Topology``; :class:`WireError` on ``field``'s paths for a count
    of 0 (each one), then with ``limits`` for counts over the limits (each one) and sizes over them,
    then for what ``eplb.Topology`` refuses."""
    missing = [(f"{field}.{name}", "must be >= 1") for name in _COUNTS if getattr(msg, name) == 0]
    if missing:
        raise WireError(*missing[0], *missing[1:])
    if limits:
        _check_limits(msg, field)
    try:
        return eplb.Topology(
            msg.num_layers, msg.num_experts, msg.num_slots, msg.num_gpus, msg.num_nodes or 1, msg.num_groups or 1
        )
    except ValueError as exc:
        raise WireError(field, str(exc)) from None


def _check_limits(msg: pb.Topology, field: str) -> None:
    caps = (_limits.MAX_LAYERS, _limits.MAX_EXPERTS, _limits.MAX_SLOTS, _limits.MAX_GPUS)
    over = [
        (f"{field}.{name}", f"{getattr(msg, name)} is over the limit of {cap}")
        for name, cap in zip(_COUNTS, caps, strict=True)
        if getattr(msg, name) > cap
    ]
    if over:
        raise WireError(*over[0], *over[1:])
    sizes = (
        ("placement", "num_slots", 4, _limits.MAX_PLACEMENT_BYTES),
        ("window", "num_experts", 8, _limits.MAX_WINDOW_BYTES),
    )
    for what, width, itemsize, cap in sizes:
        size = msg.num_layers * getattr(msg, width) * itemsize
        if size > cap:
            raise WireError(
                field,
                f"a {what} of num_layers x {width} ({msg.num_layers} x {getattr(msg, width)}) takes "
                f"{size} bytes, over the limit of {cap}",
            )

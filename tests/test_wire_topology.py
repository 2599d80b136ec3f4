"""eplb_wire.topology: the one topology codec, and its errors naming the field paths."""

from __future__ import annotations

import pytest

import eplb
from eplb import limits
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.errors import WireError
from eplb_wire.topology import topology_from_pb, topology_to_pb


def test_a_topology_goes_and_comes_back():
    topo = eplb.Topology(4, 64, 72, 8, 2, 4)
    assert topology_from_pb(topology_to_pb(topo)) == topo


def test_zero_nodes_and_groups_mean_one():
    assert topology_from_pb(pb.Topology(num_layers=1, num_experts=8, num_slots=8, num_gpus=4)) == eplb.Topology(
        1, 8, 8, 4
    )


def test_every_zero_count_is_named():
    with pytest.raises(WireError) as info:
        topology_from_pb(pb.Topology(num_layers=1, num_experts=8), "d.topology")
    assert info.value.violations == (("d.topology.num_slots", "must be >= 1"), ("d.topology.num_gpus", "must be >= 1"))


def test_limits_are_checked_only_when_asked():
    msg = pb.Topology(num_layers=limits.MAX_LAYERS + 1, num_experts=8, num_slots=8, num_gpus=4)
    with pytest.raises(WireError) as info:
        topology_from_pb(msg, limits=True)
    assert info.value.field == "topology.num_layers"
    assert info.value.description == f"{limits.MAX_LAYERS + 1} is over the limit of {limits.MAX_LAYERS}"


def test_what_eplb_topology_refuses_is_a_wire_error_on_the_message():
    with pytest.raises(WireError) as info:
        topology_from_pb(pb.Topology(num_layers=1, num_experts=8, num_slots=9, num_gpus=4), "t")
    assert info.value.field == "t" and isinstance(info.value, ValueError)

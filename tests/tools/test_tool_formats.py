"""Placement formats: each round-trips exactly; malformed input names field and expectation."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb import formats
from eplb.workloads import SCALES, make_loads


@pytest.fixture(scope="module")
def placement() -> eplb.Placement:
    topo = eplb.Topology(2, 8, 12, 4, 2, 2)
    return eplb.rebalance(make_loads("zipf-1.0", topo), topo, "global").placement


def test_native_round_trip_keeps_topology_and_stats(placement):
    doc = formats.to_native(placement, {"mean_imbalance": 1.01})
    assert doc["topology"] == {
        "num_layers": 2,
        "num_experts": 8,
        "num_slots": 12,
        "num_gpus": 4,
        "num_nodes": 2,
        "num_groups": 2,
    }
    assert doc["stats"] == {"mean_imbalance": 1.01}
    assert formats.from_native(doc) == placement


def test_sglang_round_trip(placement):
    doc = formats.to_sglang(placement)
    assert list(doc) == ["physical_to_logical_map"]
    assert np.array(doc["physical_to_logical_map"]).shape == (2, 12)
    assert formats.from_sglang(doc, num_gpus=4, num_nodes=2, num_groups=2) == placement


def test_vllm_round_trip_and_shapes(placement):
    arrays = formats.to_vllm(placement)
    assert arrays["physical_to_logical"].shape == (2, 12)
    assert arrays["logical_to_physical"].shape == (2, 8, 12 - 8 + 1)
    assert arrays["logical_replica_count"].sum(axis=1).tolist() == [12, 12]
    # Padding is -1 beyond each expert's count.
    width = (arrays["logical_to_physical"] >= 0).sum(axis=2)
    assert np.array_equal(width, arrays["logical_replica_count"])
    assert formats.from_vllm(arrays, num_gpus=4, num_nodes=2, num_groups=2) == placement


def test_vllm_reader_accepts_replicas_in_any_order(placement):
    arrays = formats.to_vllm(placement)
    # Descending slot order per expert, padding still last.
    l2p = -np.sort(-arrays["logical_to_physical"], axis=2)
    assert not np.array_equal(l2p, arrays["logical_to_physical"])
    assert formats.from_vllm(arrays | {"logical_to_physical": l2p}, num_gpus=4, num_nodes=2, num_groups=2) == placement


def test_listing_round_trip_and_loads(placement):
    loads = make_loads("zipf-1.0", placement.topology)
    text = formats.to_listing(placement, loads)
    assert text.startswith("# eplb placement listing, format 1: layers=2 experts=8 slots=12 gpus=4 nodes=2 groups=2\n")
    # A listing written before the header named its format reads the same.
    old = text.replace("# eplb placement listing, format 1:", "# eplb placement v1:", 1)
    assert formats.from_listing(old) == formats.from_listing(text)
    assert len([ln for ln in text.splitlines() if ln.startswith("layer ")]) == 2 * 4
    assert "layer 1 gpu 3 node 1: " in text
    assert formats.from_listing(text) == placement


def test_listing_of_a_standard_scale_round_trips():
    topo = SCALES["v3-prefill"]
    p = eplb.Placement.contiguous(topo)
    assert formats.from_listing(formats.to_listing(p)) == p


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"format": "eplb-placement", "version": 1, "phy2log": [[0]]}, "field 'topology': missing"),
        (
            {"format": "eplb-placement", "version": 1, "topology": {"num_layers": 1}, "phy2log": [[0]]},
            "field 'topology.num_experts': missing; expected a positive integer",
        ),
        (
            {
                "format": "eplb-placement",
                "version": 1,
                "topology": {"layers": 1, "experts": 2, "slots": 2, "gpus": 1, "cores": 3},
                "phy2log": [[0, 1]],
            },
            "field 'topology': unknown keys cores",
        ),
        (
            {
                "format": "eplb-placement",
                "version": 1,
                "topology": {"layers": 1, "experts": 2, "slots": 2, "gpus": 1},
                "phy2log": [[0, 0]],
            },
            "field 'phy2log': phy2log leaves expert 1 of layer 0 without a replica",
        ),
        (
            {
                "format": "eplb-placement",
                "version": 1,
                "topology": {"layers": 1, "experts": 2, "slots": 2, "gpus": 1},
                "phy2log": [[0, "a"]],
            },
            "field 'phy2log': expected integers",
        ),
        (
            {
                "format": "eplb-placement",
                "version": 1,
                "topology": {"layers": 1, "experts": 2, "slots": 3, "gpus": 2},
                "phy2log": [[0, 1, 1]],
            },
            r"field 'topology': num_slots \(3\) must be a multiple of num_gpus \(2\)",
        ),
    ],
)
def test_malformed_native_placement_names_field(doc, message):
    with pytest.raises(ValueError, match=message):
        formats.from_native(doc)


def test_malformed_engine_placements_name_field(placement):
    with pytest.raises(ValueError, match="field 'physical_to_logical_map': missing"):
        formats.from_sglang({"phy2log": [[0]]}, num_gpus=1)
    bad = formats.to_vllm(placement) | {"logical_replica_count": np.ones((2, 8), dtype=np.int64)}
    with pytest.raises(
        ValueError, match="field 'logical_replica_count': expected shape \\[2, 8\\] equal to the replica counts"
    ):
        formats.from_vllm(bad, num_gpus=4)
    l2p = formats.to_vllm(placement)["logical_to_physical"].copy()
    l2p[0, 0, 0], l2p[0, 1, 0] = l2p[0, 1, 0], l2p[0, 0, 0]
    with pytest.raises(
        ValueError, match="field 'logical_to_physical': lists a slot whose physical_to_logical entry is another expert"
    ):
        formats.from_vllm(formats.to_vllm(placement) | {"logical_to_physical": l2p}, num_gpus=4)
    with pytest.raises(ValueError, match="line 1: expected '# eplb placement listing, format 1: layers=L"):
        formats.from_listing("layer 0 gpu 0 node 0: 1 2\n")
    text = formats.to_listing(placement).replace("layer 1 gpu 2 node 1:", "layer 1 gpu 2 node 1: 9")
    with pytest.raises(ValueError, match=r"line \d+: expected 'layer L gpu G node N: ' and 3 expert ids"):
        formats.from_listing(text)


@given(st.integers(1, 3), st.integers(1, 6), st.integers(0, 4), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_every_format_round_trips_random_placements(layers, experts, extra_per_gpu, gpus, seed):
    slots = experts + (-experts) % gpus + extra_per_gpu * gpus
    topo = eplb.Topology(layers, experts, slots, gpus)
    rng = np.random.default_rng(seed)
    # Each layer: every expert once, the rest random, shuffled.
    fill = np.concatenate(
        [np.broadcast_to(np.arange(experts), (layers, experts)), rng.integers(0, experts, (layers, slots - experts))],
        axis=1,
    )
    p = eplb.Placement(rng.permuted(fill, axis=1), topo)
    assert formats.from_native(formats.to_native(p)) == p
    assert formats.from_sglang(formats.to_sglang(p), num_gpus=gpus) == p
    assert formats.from_vllm(formats.to_vllm(p), num_gpus=gpus) == p
    assert formats.from_listing(formats.to_listing(p)) == p

"""The pieces of ``eplb demo --rejoin-at`` that run without processes: the plan every rank
computes, the half-way map the mover starts from, and the restarted rank's load."""

from __future__ import annotations

import numpy as np

import eplb
from eplb.survivor_rules import SURVIVOR_OPTIONS, SURVIVOR_POLICY
from eplb_tools.demo import _TENSORS, DemoConfig, _code, make_weights, slot_experts
from eplb_tools.demo_failure import checkpoint
from eplb_tools.demo_rejoin import load_slots, rejoin_plan, staged


def _survivor_version(topo: eplb.Topology, down: int) -> object:
    """Version 2: the survivor placement of the contiguous map with gpu ``down`` out, as the
    service publishes it (loads attached)."""
    from eplb_engine.wire import PublishedPlacement
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    loads = np.random.default_rng(0).random((topo.num_layers, topo.num_experts)) + 0.1
    previous = eplb.Placement.contiguous(topo)
    plan = eplb.rebalance(loads, topo, SURVIVOR_POLICY, previous=previous, down_gpus=[down], **SURVIVOR_OPTIONS)
    return PublishedPlacement("demo", 2, plan.placement, pb.PlanStats(), (down,), 2, 1, loads)


def test_the_rejoin_plan_is_the_services_up_plan_and_fills_the_rank_back():
    topo = DemoConfig(ranks=3, fail_rank=1, fail_at=5).topology
    base = _survivor_version(topo, 1)
    S = topo.slots_per_gpu
    assert (base.placement.phy2log[:, S : 2 * S] == -1).all()
    plan = rejoin_plan(base, base.placement)
    # The call the service makes for SetRanksDown(up=[1]), so its plan is this map.
    want = eplb.rebalance(base.loads, topo, SURVIVOR_POLICY, previous=base.placement, down_gpus=[], **SURVIVOR_OPTIONS)
    np.testing.assert_array_equal(plan.placement.phy2log, want.placement.phy2log)
    assert (plan.version, plan.survivor_of, plan.down_ranks) == (3, 2, ())
    assert (plan.placement.phy2log[:, S : 2 * S] >= 0).all()
    # Every rank computes it alike, the restarted one from the pickled word of the survivors.
    again = rejoin_plan(base, eplb.Placement(base.placement.phy2log.copy(), topo))
    np.testing.assert_array_equal(again.placement.phy2log, plan.placement.phy2log)


def test_the_mover_starts_from_the_routed_map_with_the_restarted_ranks_slots_loaded():
    topo = DemoConfig(ranks=3, fail_rank=1, fail_at=5).topology
    base = _survivor_version(topo, 1)
    plan = rejoin_plan(base, base.placement).placement
    start = staged(base.placement, plan, 1)
    S = topo.slots_per_gpu
    np.testing.assert_array_equal(start.phy2log[:, S : 2 * S], plan.phy2log[:, S : 2 * S])
    keep = np.r_[0:S, 2 * S : 3 * S]
    np.testing.assert_array_equal(start.phy2log[:, keep], base.placement.phy2log[:, keep])
    start.validate(topo)  # every expert held: the survivors' slots alone hold them all


def test_the_restarted_rank_loads_its_slots_from_the_checkpoint():
    topo = DemoConfig(ranks=3, fail_rank=1, fail_at=5).topology
    base = _survivor_version(topo, 1)
    plan = rejoin_plan(base, base.placement).placement
    layers = make_weights(topo, 1, base.placement)  # -1 slots: no expert's code
    loaded = load_slots(layers, plan, 1, checkpoint(_TENSORS, _code))
    S = topo.slots_per_gpu
    assert loaded == topo.num_layers * S
    np.testing.assert_array_equal(slot_experts(layers, topo), plan.phy2log[:, S : 2 * S])

"""transfer_plan: the copies that turn one placement into another, and who sends them."""

import numpy as np
import pytest

import eplb
from eplb.transfer import INTER_NODE, INTRA_NODE, LOCAL, transfer_plan
from eplb.workloads import make_loads


def _plans(seed: int = 0) -> tuple[eplb.Topology, eplb.Placement, eplb.Placement]:
    topo = eplb.Topology(4, 32, 48, 8, 2, 4)
    loads = make_loads("lognormal-1.0", topo, seed)
    old = eplb.rebalance(loads, topo, "global").placement
    new = eplb.rebalance(make_loads("zipf-1.0", topo, seed + 1), topo, "global").placement
    return topo, old, new


def test_exactly_the_changed_slots_get_a_copy_of_their_new_expert() -> None:
    topo, old, new = _plans()
    tp = transfer_plan(old, new, topo, expert_bytes=3.0)
    want = np.argwhere(old.phy2log != new.phy2log)
    got = np.stack([tp.layer, tp.dst_slot], axis=1)
    assert np.array_equal(got[np.lexsort((tp.dst_slot, tp.layer))], want)
    assert tp.num_transfers == int(eplb.moves(old, new).sum())
    assert np.array_equal(tp.expert, new.phy2log[tp.layer, tp.dst_slot])


def test_sources_held_the_expert_in_the_old_placement() -> None:
    topo, old, new = _plans(1)
    tp = transfer_plan(old, new, topo)
    assert np.array_equal(old.phy2log[tp.layer, tp.src_slot], tp.expert)
    assert np.array_equal(tp.src_gpu, tp.src_slot // topo.slots_per_gpu)
    assert np.array_equal(tp.dst_gpu, tp.dst_slot // topo.slots_per_gpu)


def test_nearest_source_kind_is_chosen() -> None:
    topo, old, new = _plans(2)
    tp = transfer_plan(old, new, topo)
    S, gpn = topo.slots_per_gpu, topo.gpus_per_node
    holders = old.phy2log.reshape(topo.num_layers, topo.num_gpus, S)
    for i in range(tp.num_transfers):
        gpus = np.flatnonzero((holders[tp.layer[i]] == tp.expert[i]).any(axis=1))
        if tp.dst_gpu[i] in gpus:
            best = LOCAL
        elif (gpus // gpn == tp.dst_gpu[i] // gpn).any():
            best = INTRA_NODE
        else:
            best = INTER_NODE
        assert tp.kind[i] == best
    assert (tp.kind == LOCAL).any() and (tp.kind == INTER_NODE).any()
    same_gpu = tp.src_gpu == tp.dst_gpu
    assert np.array_equal(same_gpu, tp.kind == LOCAL)
    assert np.array_equal(tp.src_gpu // gpn == tp.dst_gpu // gpn, tp.kind != INTER_NODE)


def test_senders_share_the_work_when_many_gpus_hold_the_expert() -> None:
    # Gpus 0-3 hold expert 0; gpus 4-7 need it. One sender for all four would be a hot spot.
    topo = eplb.Topology(2, 8, 16, 8)
    old = np.array([[0, 1, 0, 2, 0, 3, 0, 4, 5, 1, 6, 2, 7, 3, 5, 4]] * 2)
    new = old.copy()
    new[:, [8, 10, 12, 14]] = 0
    new[:, [1, 3, 5, 7]] = [5, 6, 7, 5]
    tp = transfer_plan(eplb.Placement(old, topo), eplb.Placement(new, topo), topo, expert_bytes=10.0)
    from_zero = tp.expert == 0
    assert from_zero.sum() == 8
    assert np.bincount(tp.src_gpu[from_zero], minlength=8)[:4].tolist() == [2, 2, 2, 2]
    assert tp.sent_bytes.sum() == pytest.approx(10.0 * tp.num_transfers)


def test_sent_bytes_stay_near_the_mean_on_random_plans() -> None:
    topo = eplb.Topology(16, 64, 128, 16, 2, 8)
    loads = make_loads("lognormal-1.0", topo, 0)
    old = eplb.rebalance(loads, topo, "global").placement
    new = eplb.rebalance(make_loads("lognormal-1.0", topo, 1), topo, "global").placement
    tp = transfer_plan(old, new, topo, expert_bytes=1.0)
    sent = tp.sent_bytes
    assert sent.sum() > 0
    # Forced sends (an expert with one holder) set a floor; beyond it the greedy spreads evenly.
    assert sent.max() <= 1.5 * sent.mean()


def test_byte_totals_add_up() -> None:
    topo, old, new = _plans(3)
    size = np.arange(1, topo.num_layers + 1, dtype=np.float64) * 100
    tp = transfer_plan(old, new, topo, expert_bytes=size)
    remote = tp.kind != LOCAL
    assert tp.sent_bytes.sum() == pytest.approx(size[tp.layer[remote]].sum())
    assert tp.received_bytes.sum() == pytest.approx(tp.sent_bytes.sum())
    assert tp.local_bytes.sum() == pytest.approx(size[tp.layer[~remote]].sum())
    assert tp.cross_node_bytes == pytest.approx(size[tp.layer[tp.kind == INTER_NODE]].sum())
    assert tp.cross_node_received_bytes.sum() == pytest.approx(tp.cross_node_bytes)
    assert sum(tp.kind_counts().values()) == tp.num_transfers


def test_identical_placements_need_no_transfers() -> None:
    topo, old, _ = _plans()
    tp = transfer_plan(old, old, topo, expert_bytes=1.0)
    assert tp.num_transfers == 0
    assert tp.sent_bytes.shape == (topo.num_gpus,) and not tp.sent_bytes.any()


def test_bad_inputs_are_rejected() -> None:
    topo, old, new = _plans()
    with pytest.raises(ValueError, match="expert_bytes"):
        transfer_plan(old, new, topo, expert_bytes=-1.0)
    with pytest.raises(ValueError, match="old must be a Placement"):
        transfer_plan(old.phy2log, new, topo)
    other = topo.with_layers(1)
    with pytest.raises(ValueError, match="placement is for"):
        transfer_plan(old, new, other)

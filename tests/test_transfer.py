"""transfer_plan: the copies that turn one placement into another, and who sends them."""

import numpy as np
import pytest

import eplb
from eplb.transfer import INTER_NODE, INTRA_NODE, LOCAL, Bandwidth, transfer_plan, transfer_schedule
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


# -- transfer_schedule ---------------------------------------------------------------------


def _random_placement(topo: eplb.Topology, rng: np.random.Generator) -> eplb.Placement:
    """Every expert once, the other slots random experts, shuffled: replica gains and losses."""
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return eplb.Placement(rng.permuted(rows, axis=1), topo)


def _random_topology(rng: np.random.Generator) -> eplb.Topology:
    G = int(rng.choice([1, 2, 4, 8]))
    N = int(rng.choice([n for n in (1, 2, 4) if G % n == 0]))
    P = G * int(rng.integers(1, 5))
    return eplb.Topology(int(rng.integers(1, 4)), int(rng.integers(1, P + 1)), P, G, N)


def test_schedule_writes_every_changed_slot_once_from_a_holder_of_its_expert() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        topo = _random_topology(rng)
        old, new = _random_placement(topo, rng), _random_placement(topo, rng)
        s = transfer_schedule(old, new, topo, round_experts=int(rng.integers(1, 3)))
        cover = np.zeros((topo.num_layers, topo.num_slots), dtype=np.int64)
        for lay, dst in (
            (s.recv_layer, s.recv_dst_slot),
            (s.local_layer, s.local_dst_slot),
            (s.fill_layer, s.fill_dst_slot),
        ):
            np.add.at(cover, (lay, dst), 1)
        assert np.array_equal(cover, (old.phy2log != new.phy2log).astype(np.int64))
        S = topo.slots_per_gpu
        assert np.array_equal(old.phy2log[s.recv_layer, s.recv_src_slot], s.recv_expert)
        assert np.array_equal(new.phy2log[s.recv_layer, s.recv_dst_slot], s.recv_expert)
        assert (s.recv_src_slot // S != s.recv_dst_slot // S).all()
        assert np.array_equal(
            old.phy2log[s.local_layer, s.local_src_slot], new.phy2log[s.local_layer, s.local_dst_slot]
        )
        assert (s.local_src_slot // S == s.local_dst_slot // S).all()
        # a fill copies a received slot of the same gpu holding the same expert
        assert np.array_equal(new.phy2log[s.fill_layer, s.fill_src_slot], new.phy2log[s.fill_layer, s.fill_dst_slot])
        received = set(zip(s.recv_layer.tolist(), s.recv_dst_slot.tolist()))
        assert all((lay, src) in received for lay, src in zip(s.fill_layer.tolist(), s.fill_src_slot.tolist()))
        # one receive per (layer, gpu, expert)
        keys = np.stack([s.recv_layer, s.recv_dst_gpu, s.recv_expert], axis=1)
        assert len(np.unique(keys, axis=0)) == len(keys)


def test_each_gpu_exchanges_with_at_most_one_peer_per_round() -> None:
    rng = np.random.default_rng(1)
    for _ in range(100):
        topo = _random_topology(rng)
        cap = int(rng.integers(1, 3))
        s = transfer_schedule(_random_placement(topo, rng), _random_placement(topo, rng), topo, round_experts=cap)
        for lay in range(topo.num_layers):
            for r in range(int(s.rounds[lay])):
                m = (s.recv_layer == lay) & (s.recv_round == r)
                assert m.any(), "no empty rounds"
                peers: dict[int, set[int]] = {}
                for a, b in zip(s.recv_src_gpu[m].tolist(), s.recv_dst_gpu[m].tolist()):
                    peers.setdefault(a, set()).add(b)
                    peers.setdefault(b, set()).add(a)
                assert all(len(p) == 1 for p in peers.values())
                _, per_pair = np.unique(np.stack([s.recv_src_gpu[m], s.recv_dst_gpu[m]], 1), axis=0, return_counts=True)
                assert per_pair.max() <= cap


def test_schedule_prefers_a_same_node_partner_in_a_round() -> None:
    # gpu 0 needs an expert only gpu 1 (same node) holds and one only gpu 2 (other node) holds.
    topo = eplb.Topology(1, 4, 4, 4, 2)
    old = eplb.Placement(np.array([[0, 1, 2, 3]]), topo)
    new = eplb.Placement(np.array([[1, 2, 3, 0]]), topo)
    s = transfer_schedule(old, new, topo)
    first = s.recv_round == 0
    pairs = {frozenset(p) for p in zip(s.recv_src_gpu[first].tolist(), s.recv_dst_gpu[first].tolist())}
    assert pairs == {frozenset({0, 1}), frozenset({2, 3})}
    assert s.rounds.tolist() == [2]


def test_schedule_figures_on_a_hand_checked_example() -> None:
    # 2 gpus x 3 slots, one node. gpu 0 swaps slots 0 and 1 (a cycle); gpu 1 receives expert 0.
    topo = eplb.Topology(1, 4, 6, 2)
    old = eplb.Placement(np.array([[0, 1, 2, 3, 2, 3]]), topo)
    new = eplb.Placement(np.array([[1, 0, 2, 0, 2, 3]]), topo)
    bw = Bandwidth(local_gb_s=1.0, intra_node_gb_s=0.5, inter_node_gb_s=0.1, round_latency_s=0.25)
    s = transfer_schedule(old, new, topo, expert_bytes=1e9, bandwidth=bw)
    assert s.cycles.tolist() == [[1, 0]]
    assert s.recv_dst_slot.tolist() == [3] and s.recv_src_gpu.tolist() == [0]
    assert s.local_dst_slot.tolist() == [0, 1] and s.fill_layer.size == 0
    assert s.rounds.tolist() == [1]
    assert s.max_rank_round_bytes == 1e9
    # one round: 1 GB at 0.5 GB/s + latency; local: gpu 0 copies 2 + 1 (cycle), gpu 1 lands 1
    assert s.predicted_comm_seconds.tolist() == pytest.approx([2.25])
    assert s.predicted_local_seconds.tolist() == pytest.approx([3.0])
    assert s.local_copy_bytes.tolist() == [[3e9, 1e9]]
    assert s.stats() == {
        "bytes": 10**9,
        "cross_node_bytes": 0,
        "rounds": 1,
        "max_rank_round_bytes": 10**9,
        "predicted_seconds": pytest.approx(5.25),
    }


def test_one_receive_serves_several_slots_of_a_gpu() -> None:
    topo = eplb.Topology(1, 4, 8, 2)
    old = eplb.Placement(np.array([[0, 1, 2, 3, 0, 1, 2, 3]]), topo)
    new = eplb.Placement(np.array([[0, 1, 2, 3, 0, 0, 0, 3]]), topo)
    s = transfer_schedule(old, new, topo, expert_bytes=2.0)
    assert s.recv_layer.size == 0  # gpu 1 already holds expert 0
    old = eplb.Placement(np.array([[0, 1, 2, 3, 0, 1, 0, 1]]), topo)
    new = eplb.Placement(np.array([[0, 1, 2, 3, 0, 2, 2, 1]]), topo)
    s = transfer_schedule(old, new, topo, expert_bytes=2.0)
    assert s.recv_dst_slot.tolist() == [5] and s.fill_dst_slot.tolist() == [6] and s.fill_src_slot.tolist() == [5]
    assert s.bytes == 2.0 and s.received_bytes.tolist() == [[0.0, 2.0]]


def test_round_cap_trades_rounds_for_bytes_per_round() -> None:
    topo, old, new = _plans(4)
    free = transfer_schedule(old, new, topo, expert_bytes=1.0)
    capped = transfer_schedule(old, new, topo, expert_bytes=1.0, round_experts=1)
    assert capped.total_rounds > free.total_rounds
    assert capped.max_rank_round_bytes == 1.0 < free.max_rank_round_bytes
    assert capped.bytes == free.bytes


def test_sources_prefer_a_slot_that_keeps_its_expert() -> None:
    # gpu 0 holds expert 0 in slots 0 (changes) and 1 (keeps); gpu 1 needs expert 0.
    topo = eplb.Topology(1, 3, 4, 2)
    old = eplb.Placement(np.array([[0, 0, 1, 2]]), topo)
    new = eplb.Placement(np.array([[1, 0, 0, 2]]), topo)
    tp = transfer_plan(old, new, topo)
    assert tp.src_slot[tp.dst_slot == 2].tolist() == [1]


def test_no_change_means_an_empty_schedule() -> None:
    topo, old, _ = _plans()
    s = transfer_schedule(old, old, topo, expert_bytes=5.0)
    assert s.total_rounds == 0 and s.predicted_seconds == 0.0 and s.bytes == 0.0 and s.max_rank_round_bytes == 0.0


def test_schedule_bad_inputs_are_rejected() -> None:
    topo, old, new = _plans()
    with pytest.raises(ValueError, match="round_experts"):
        transfer_schedule(old, new, topo, round_experts=0)
    with pytest.raises(ValueError, match="intra_node_gb_s"):
        Bandwidth(intra_node_gb_s=0.0)
    with pytest.raises(ValueError, match="bandwidth must be a Bandwidth"):
        transfer_schedule(old, new, topo, bandwidth={"local_gb_s": 1.0})

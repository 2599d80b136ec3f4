"""eplb.replan.moves: rotations, ejection chains and count repairs."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import eplb


def _drifted_layout(
    data: st.DataObject, gpus: tuple[int, int], slots: tuple[int, int], spare: int, sigma: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two layers planned by `global`, then drifted: the drifted loads ``[2, E]``, the plan's
    ``[2, B, S]`` experts per gpu and a target ``[2]`` at a drawn quantile of the gpu loads."""
    from eplb.layout import bin_loads

    B = data.draw(st.integers(*gpus), label="gpus")
    S = data.draw(st.integers(*slots), label="slots per gpu")
    E = data.draw(st.integers(S, B * S - spare), label="experts")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    loads = rng.lognormal(0, 1, (2, E))
    topo = eplb.Topology(2, E, B * S, B)
    phy = eplb.rebalance(loads, topo, "global").phy2log.reshape(2, B, S).astype(np.int64)
    drifted = loads * rng.lognormal(0, sigma, loads.shape)
    bins = bin_loads(drifted, phy)
    target = np.quantile(bins, data.draw(st.floats(0.3, 0.95), label="target quantile"), axis=1)
    return drifted, phy, target


def _repair_keeping_counts(repair, drifted: np.ndarray, phy: np.ndarray, target: np.ndarray) -> tuple:
    """Runs ``repair(drifted, phy, target)`` in place and checks what every counts-kept repair
    keeps: replica counts, no expert twice on a gpu, untouched bins' loads. Returns the bin
    loads before and after ``[2, B]`` and which bins it touched."""
    from eplb.layout import bin_loads, replica_counts

    E, S = drifted.shape[1], phy.shape[2]
    before, bins = phy.copy(), bin_loads(drifted, phy)
    repair(drifted, phy, target)
    after = bin_loads(drifted, phy)
    assert (replica_counts(phy, E) == replica_counts(before, E)).all()
    assert all(len(set(g)) == S for g in phy.reshape(-1, S).tolist())
    touched = (phy != before).any(axis=2)
    assert np.allclose(after[~touched], bins[~touched])
    return bins, after, touched


def test_a_rotation_fixes_two_gpus_with_three_slots() -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.replan.moves import rotate_improve

    # Gpus 0 and 1 are 1 above the target of 10; gpu 2 has room. Expert weights: 5, 4, 3, 2, 1.
    # A rotation: gpu 0 gives 5 to gpu 2, gpu 2 gives 3 to gpu 1, gpu 1 gives 4 to gpu 0.
    loads = np.array([[5.0, 4.0, 3.0, 6.0, 7.0, 2.0]])
    phy = np.array([[[0, 3], [1, 4], [2, 5]]])  # loads 11, 11, 5
    target = np.array([10.0])
    before = phy.copy()
    rotate_improve(loads, phy, target)
    assert (bin_loads(loads, phy) <= 10.0).all()
    assert (phy != before).sum() == 3
    assert (replica_counts(phy, 6) == replica_counts(before, 6)).all()
    assert all(len(set(g)) == 2 for g in phy[0].tolist())


@given(data=st.data())
def test_rotations_never_overload_a_gpu_or_change_counts(data: st.DataObject) -> None:
    from eplb.replan.moves import rotate_improve

    drifted, phy, target = _drifted_layout(data, (3, 8), (1, 4), 0, 0.3)
    B = phy.shape[1]
    _, after, touched = _repair_keeping_counts(rotate_improve, drifted, phy, target)
    # Every bin a rotation touched ends at most at the target.
    assert (after[touched] <= np.repeat(target[:, None], B, axis=1)[touched] + 1e-9).all()


def test_an_ejection_chain_fixes_three_gpus_with_four_slots() -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.replan.moves import chain_improve

    # Target 20. Gpu 0 (load 10) has room 10; gpus 1, 2, 3 are 1, 2 and 3 above the target.
    # The chain: gpu 0 gives 1 to gpu 1, gpu 1 gives 3 to gpu 2, gpu 2 gives 6 to gpu 3 and
    # gpu 3 gives 9.5 to gpu 0: four slots for three gpus (swaps would take six).
    loads = np.array([[1.0, 9.0, 3.0, 18.0, 6.0, 16.0, 9.5, 13.5]])
    phy = np.array([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    before = phy.copy()
    chain_improve(loads, phy, np.array([20.0]))
    assert (bin_loads(loads, phy) <= 20.0).all()
    assert (phy != before).sum() == 4
    assert phy[0].tolist() == [[6, 1], [0, 3], [2, 5], [4, 7]]
    assert (replica_counts(phy, 8) == replica_counts(before, 8)).all()


@given(data=st.data())
def test_chains_fix_gpus_for_at_most_one_and_a_half_slots_each(data: st.DataObject) -> None:
    from eplb.replan.moves import chain_improve

    drifted, phy, target = _drifted_layout(data, (3, 10), (1, 4), 0, 0.3)
    B = phy.shape[1]
    before = phy.copy()
    bins, after, touched = _repair_keeping_counts(chain_improve, drifted, phy, target)
    tgt = np.repeat(target[:, None], B, axis=1)
    # Touched bins end at most at the target; each chain of k >= 2 bins above the target
    # rewrites k + 1 slots.
    assert (after[touched] <= tgt[touched] * (1 + 1e-9)).all()
    fixed = ((bins > tgt * (1 + 1e-12)) & (after <= tgt * (1 + 1e-9))).sum()
    assert (phy != before).sum() <= 1.5 * fixed


def test_one_count_move_fixes_every_gpu_of_an_expert_that_grew() -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.replan.moves import count_repair

    # Expert 0 (30) has three replicas on gpus 0-2, each 1.2 above the target of 10. Writing a
    # fourth over one of expert 1's two replicas brings all three under it with one slot
    # (swaps would rewrite six).
    loads = np.array([[30.0, 4.0, 1.2, 1.2, 1.2, 2.0, 2.0]])
    phy = np.array([[[0, 2], [0, 3], [0, 4], [1, 5], [1, 6]]])
    before = phy.copy()
    count_repair(loads, phy, np.array([10.0]), cap=5)
    assert (bin_loads(loads, phy) <= 10.0).all()
    assert (phy != before).sum() == 1
    assert replica_counts(phy, 7)[0, :2].tolist() == [4, 1]


@given(data=st.data())
def test_count_repairs_fix_at_least_a_gpu_per_slot(data: st.DataObject) -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.planner.replicate import replica_cap
    from eplb.replan.moves import count_repair

    drifted, phy, target = _drifted_layout(data, (2, 10), (2, 4), 1, 0.5)
    E, (_, B, S) = drifted.shape[1], phy.shape
    before, bins = phy.copy(), bin_loads(drifted, phy)
    count_repair(drifted, phy, target, replica_cap(E, B * S, B))
    after = bin_loads(drifted, phy)
    cnt = replica_counts(phy, E)
    assert (cnt >= 1).all() and (cnt.sum(axis=1) == B * S).all()
    assert all(len(set(g)) == S for g in phy.reshape(-1, S).tolist())
    # Each rewritten slot is a count move that left at least one gpu fewer above the target,
    # and the excess above it only shrank.
    over = lambda x: (x > target[:, None] * (1 + 1e-12)).sum(axis=1)  # noqa: E731
    moved = (phy != before).sum(axis=(1, 2))
    assert (over(after) <= over(bins) - moved).all()
    excess = lambda x: np.maximum(x - target[:, None] * (1 + 1e-12), 0).sum(axis=1)  # noqa: E731
    assert (excess(after) <= excess(bins) + 1e-9).all()

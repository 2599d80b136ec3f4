"""Engine adapters: vLLM's EplbModelState and SGLang's ExpertLocationMetadata maps, on torch
tensors, without either engine installed."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import eplb
from eplb_engine.adapters.sglang import (
    apply_to_sglang,
    from_sglang,
    rank_dispatch_map,
    sglang_expert_loads,
    to_sglang,
)
from eplb_engine.adapters.vllm import (
    VLLM_MAP_WIDTH,
    apply_to_vllm,
    from_vllm,
    to_vllm,
    vllm_expert_loads,
    vllm_release,
    vllm_slot_loads,
)

# vLLM's own example (eplb_state.py docstrings): 2 layers, 6 physical, 4 logical, 3 EP ranks.
VLLM_P2L = [[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]]
VLLM_L2P = [[[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]], [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]]]
VLLM_COUNT = [[2, 2, 1, 1], [3, 1, 1, 1]]


def _random_placement(rng: np.random.Generator, G: int | None = None) -> eplb.Placement:
    G = G or int(rng.choice([1, 2, 4, 8]))
    P = G * int(rng.integers(1, 5))
    L, E = int(rng.integers(1, 4)), int(rng.integers(1, P + 1))
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return eplb.Placement(rng.permuted(rows, axis=1), eplb.Topology(L, E, P, G))


def test_vllm_maps_match_vllms_documented_example() -> None:
    topo = eplb.Topology(2, 4, 6, 3)
    maps = to_vllm(eplb.Placement(np.array(VLLM_P2L), topo), width=VLLM_MAP_WIDTH)
    assert maps.physical_to_logical_map.tolist() == VLLM_P2L
    assert maps.logical_to_physical_map.shape == (2, 4, VLLM_MAP_WIDTH) == (2, 4, 1024)
    assert maps.logical_to_physical_map[..., :3].tolist() == VLLM_L2P
    assert (maps.logical_to_physical_map[..., 3:] == -1).all()
    assert maps.logical_replica_count.tolist() == VLLM_COUNT
    assert {
        t.dtype for t in (maps.physical_to_logical_map, maps.logical_to_physical_map, maps.logical_replica_count)
    } == {torch.int64}
    assert from_vllm(maps.physical_to_logical_map, topo) == eplb.Placement(np.array(VLLM_P2L), topo)


def test_vllm_release_decides_the_map_width_and_the_recording_write() -> None:
    """vLLM 0.34.0 sizes logical_to_physical_map by the redundant slots (unless elastic EP is
    on) and writes should_record_tensor only on a change; earlier releases: 1024, every step.
    A later release is taken as the newest; no vLLM installed (this suite): the newest."""
    for version, width, elastic, tracks in (
        ("0.32.0", 1024, 1024, False),
        ("0.33.0+cpu", 1024, 1024, False),
        ("0.34.0", 33, 1024, True),
        ("0.35.0rc1", 33, 1024, True),
    ):
        release = vllm_release(version)
        assert release.version == version
        assert (release.map_width(32), release.map_width(32, elastic_ep=True)) == (width, elastic), version
        assert release.tracks_should_record is tracks, version
    assert vllm_release() == vllm_release("0.34.0")
    with pytest.raises(ValueError, match="vLLM version 'dev' does not start with MAJOR.MINOR"):
        vllm_release("dev")
    # to_vllm's default width is the installed release's for the placement's redundant slots
    maps = to_vllm(eplb.Placement(np.array(VLLM_P2L), eplb.Topology(2, 4, 6, 3)))
    assert maps.logical_to_physical_map.shape == (2, 4, 3)


def test_apply_to_vllm_writes_the_live_tensors_in_place() -> None:
    topo = eplb.Topology(2, 4, 6, 3)
    start = to_vllm(eplb.Placement.contiguous(topo))
    state = SimpleNamespace(**{k: v.clone() for k, v in vars(start).items()})
    layer_view = state.logical_to_physical_map[1]  # what a vLLM MoE layer holds
    ptrs = [t.data_ptr() for t in vars(state).values()]
    apply_to_vllm(state, eplb.Placement(np.array(VLLM_P2L), topo))
    assert [t.data_ptr() for t in vars(state).values()] == ptrs
    assert layer_view[:, :3].tolist() == VLLM_L2P[1]
    assert state.logical_replica_count.tolist() == VLLM_COUNT
    state.logical_to_physical_map = torch.full((2, 4, 2), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="width=2 is below the most replicas of one expert \\(3\\)"):
        apply_to_vllm(state, eplb.Placement(np.array(VLLM_P2L), topo))
    state.logical_to_physical_map = torch.full((2, 5, 8), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="logical_to_physical_map of the live state has shape \\[2, 5, 8\\]"):
        apply_to_vllm(state, eplb.Placement(np.array(VLLM_P2L), topo))


def test_vllm_load_window_becomes_slot_and_expert_loads() -> None:
    window = torch.zeros((3, 2, 6), dtype=torch.int32)
    window[0, 1] = torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.int32)
    window[2, 1] = torch.tensor([10, 0, 0, 0, 0, 0], dtype=torch.int32)
    window[1, 0, 4] = 7
    assert vllm_slot_loads(window).tolist() == [[0, 0, 0, 0, 7, 0], [11, 2, 3, 4, 5, 6]]
    loads = vllm_expert_loads(window, torch.tensor(VLLM_P2L), 4)
    # layer 1: expert 0 in slots 0, 2, 4 -> 11 + 3 + 5; expert 1 slot 3; expert 2 slot 1; expert 3 slot 5
    assert loads.tolist() == [[7, 0, 0, 0], [19, 4, 2, 6]]
    with pytest.raises(ValueError, match="expert_load_window must be \\[window, layers, slots\\]"):
        vllm_slot_loads(window[0])


def test_empty_slots_of_a_gpu_down_fold_to_no_expert() -> None:
    """A survivor map (gpu 2's slots -1): the tokens recorded on its slots count for no expert
    (vLLM's fold drops them too), in vllm_expert_loads and in fold_slot_counts, torch and
    numpy. Before: an IndexError in torch, and numpy's fold added them to another expert."""
    from eplb_engine.balanced_rank import fold_slot_counts

    p2l = [[0, 1, 2, 3, -1, -1], [3, 0, 2, 1, -1, -1]]
    placement = eplb.Placement(np.array(p2l), eplb.Topology(2, 4, 6, 3))
    counts = torch.arange(12, dtype=torch.float64).reshape(2, 6) + 1
    want = [[1, 2, 3, 4], [8, 10, 9, 7]]
    assert vllm_expert_loads(counts[None], torch.tensor(p2l), 4).tolist() == want
    assert fold_slot_counts(counts, placement).tolist() == want
    assert fold_slot_counts(counts.numpy(), placement).tolist() == want
    assert to_vllm(placement).physical_to_logical_map.tolist() == p2l
    assert to_vllm(placement).logical_replica_count.tolist() == [[1] * 4] * 2


def test_sglang_maps_have_sglangs_shapes_padding_and_dtypes() -> None:
    topo = eplb.Topology(2, 4, 6, 3)
    placement = eplb.Placement(np.array(VLLM_P2L), topo)
    maps = to_sglang(placement, ep_rank=1)
    assert maps.logical_to_all_physical_map.shape == (2, 4, 6)  # padded to num_physical_experts
    assert maps.logical_to_all_physical_map[..., :3].tolist() == VLLM_L2P
    assert (maps.logical_to_all_physical_map[..., 3:] == -1).all()
    assert maps.logical_to_all_physical_map_num_valid.tolist() == VLLM_COUNT
    assert maps.physical_to_logical_map_cpu.device.type == "cpu"
    assert maps.logical_to_all_physical_map_cpu.device.type == "cpu"
    # the host copies are tensors of their own, as SGLang's are on a GPU server
    assert maps.logical_to_all_physical_map_cpu.data_ptr() != maps.logical_to_all_physical_map.data_ptr()
    assert maps.ep_size == 3
    assert all(t.dtype == torch.int64 for t in maps.fields().values() if isinstance(t, torch.Tensor))
    assert maps.logical_to_rank_dispatch_physical_map.shape == (2, 4)
    assert to_sglang(placement).logical_to_rank_dispatch_physical_map is None
    assert from_sglang(maps.physical_to_logical_map, topo) == placement


def _dispatch_by_loops(placement: eplb.Placement, ep_rank: int, seed: int = 42) -> list[list[int]]:
    """SGLang's static dispatch (0.5.23's compute_logical_to_rank_dispatch_physical_map, one
    node), one (layer, expert, gpu) at a time: an expert with one replica is that replica for
    every rank and draws nothing."""
    t = placement.topology
    r = random.Random(seed)
    out = np.full((t.num_layers, t.num_experts, t.num_gpus), -1)
    for lay in range(t.num_layers):
        for e in range(t.num_experts):
            cand = [p for p in range(t.num_slots) if placement.phy2log[lay, p] == e]
            if len(cand) == 1:
                out[lay, e] = cand[0]
                continue
            for g in range(t.num_gpus):
                same = [p for p in cand if p // t.slots_per_gpu == g]
                if same:
                    out[lay, e, g] = same[0]
            q, m = divmod(int((out[lay, e] == -1).sum()), len(cand))
            picks = cand * q + r.sample(cand, k=m)
            r.shuffle(picks)
            out[lay, e, out[lay, e] == -1] = picks
    return out[:, :, ep_rank].tolist()


def test_sglang_static_dispatch_table_matches_the_per_rank_loop_on_random_placements() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        placement = _random_placement(rng)
        G, S = placement.topology.num_gpus, placement.topology.slots_per_gpu
        tables = [rank_dispatch_map(placement, g) for g in range(G)]
        for g, table in enumerate(tables):
            assert table.tolist() == _dispatch_by_loops(placement, g)
            # every entry is a replica of its expert; a rank holding one uses its own
            lay = np.arange(table.shape[0])[:, None]
            assert (placement.phy2log[lay, table] == np.arange(table.shape[1])[None]).all()
            own = (placement.phy2log.reshape(table.shape[0], G, S)[:, g, :, None] == np.arange(table.shape[1])).any(
                axis=1
            )
            assert (table[own] // S == g).all()


def test_sglang_dispatch_spreads_ranks_without_a_replica_evenly() -> None:
    # expert 0 on gpus 0 and 1 only; gpus 2..7 lack it: 6 ranks over 2 replicas -> 3 each
    topo = eplb.Topology(1, 8, 16, 8)
    phy2log = np.array([[0, 1, 0, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]])
    placement = eplb.Placement(phy2log, topo)
    picks = [int(rank_dispatch_map(placement, g)[0, 0]) for g in range(2, 8)]
    assert sorted(picks) == [0, 0, 0, 2, 2, 2]
    with pytest.raises(ValueError, match="ep_rank must be an integer in \\[0, 8\\)"):
        rank_dispatch_map(placement, 8)


def test_sglang_dispatch_with_a_gpu_down_sends_nothing_from_it_and_nothing_to_it() -> None:
    # gpu 7 down (slots 14, 15 empty); expert 0 on gpus 0 and 1: the 5 live ranks lacking it
    # split its 2 replicas (3 + 2); rank 7 sends nothing and takes no share.
    topo = eplb.Topology(1, 8, 16, 8)
    phy2log = np.array([[0, 1, 0, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, -1, -1]])
    placement = eplb.Placement(phy2log, topo)
    assert placement.down_gpus == (7,)
    rows = [rank_dispatch_map(placement, g)[0] for g in range(8)]
    assert (rows[7] == -1).all()  # before: rank 7 drew one of expert 0's replicas like a live rank
    for g in range(7):
        assert (rows[g] >= 0).all() and (phy2log[0, rows[g]] == np.arange(8)).all()
    picks = sorted(int(rows[g][0]) for g in range(2, 7))
    assert picks in ([0, 0, 0, 2, 2], [0, 0, 2, 2, 2])


def test_apply_to_sglang_updates_the_live_metadata_in_place() -> None:
    rng = np.random.default_rng(2)
    old = _random_placement(rng, 4)
    new = eplb.Placement(rng.permuted(old.phy2log, axis=1), old.topology)
    live = SimpleNamespace(**to_sglang(old, ep_rank=3).fields())
    ptrs = {k: v.data_ptr() for k, v in vars(live).items() if isinstance(v, torch.Tensor)}
    apply_to_sglang(live, new, ep_rank=3)
    assert {k: v.data_ptr() for k, v in vars(live).items() if isinstance(v, torch.Tensor)} == ptrs
    want = to_sglang(new, ep_rank=3).fields()
    assert all(
        torch.equal(getattr(live, k), v) if isinstance(v, torch.Tensor) else getattr(live, k) == v
        for k, v in want.items()
    )
    with pytest.raises(ValueError, match="pass ep_rank"):
        apply_to_sglang(live, new)
    live.logical_to_rank_dispatch_physical_map = None  # dynamic dispatch: no table to write
    apply_to_sglang(live, old)
    assert live.physical_to_logical_map.tolist() == old.phy2log.tolist()


def test_apply_to_sglang_writes_the_moe_rows_of_a_model_with_dense_layers() -> None:
    rng = np.random.default_rng(3)
    moe = _random_placement(rng, 2)  # L MoE layers, at rows 2.. of a model with 2 dense layers first
    L, E, P = moe.topology.num_layers, moe.topology.num_experts, moe.topology.num_slots
    trivial = np.broadcast_to(np.arange(P) % E, (L + 2, P)).copy()
    live = SimpleNamespace(**to_sglang(eplb.Placement(trivial, moe.topology.with_layers(L + 2))).fields())
    apply_to_sglang(live, moe, layer_ids=list(range(2, L + 2)))
    assert live.physical_to_logical_map[:2].tolist() == trivial[:2].tolist()
    assert live.physical_to_logical_map[2:].tolist() == moe.phy2log.tolist()
    assert live.physical_to_logical_map_cpu[2:].tolist() == moe.phy2log.tolist()
    assert live.logical_to_all_physical_map_num_valid[2:].tolist() == moe.logcnt.tolist()
    with pytest.raises(ValueError, match=f"layer_ids must name {L} distinct metadata rows"):
        apply_to_sglang(live, moe, layer_ids=list(range(L + 1)))
    counts = torch.arange(2 * (L + 2) * E, dtype=torch.int64).reshape(2, L + 2, E)
    assert sglang_expert_loads(counts, list(range(2, L + 2))).tolist() == (counts.sum(0)[2:]).double().tolist()
    assert sglang_expert_loads(counts[0]).shape == (L + 2, E)


def test_adapters_write_only_the_layers_of_a_chunk() -> None:
    """A chunked rollout switches some layers at a step: only their rows change."""
    rng = np.random.default_rng(4)
    old = _random_placement(rng, 4)
    new = eplb.Placement(rng.permuted(old.phy2log, axis=1), old.topology)
    L = old.topology.num_layers
    assert L > 1
    chunk = [1]
    rest = [i for i in range(L) if i not in chunk]
    # SGLang, MoE layers at rows 2.. of the metadata
    trivial = np.concatenate([old.phy2log[:1], old.phy2log[:1], old.phy2log])
    live = SimpleNamespace(**to_sglang(eplb.Placement(trivial, old.topology.with_layers(L + 2)), ep_rank=1).fields())
    apply_to_sglang(live, new, layer_ids=list(range(2, L + 2)), ep_rank=1, layers=chunk)
    got = live.physical_to_logical_map[2:]
    assert got[chunk].tolist() == new.phy2log[chunk].tolist() and got[rest].tolist() == old.phy2log[rest].tolist()
    # the table is drawn as SGLang draws it: over every row of the metadata, dense ones included
    model = eplb.Placement(np.concatenate([trivial[:2], new.phy2log]), old.topology.with_layers(L + 2))
    assert (
        live.logical_to_rank_dispatch_physical_map[2:][chunk].tolist()
        == rank_dispatch_map(model, 1)[2:][chunk].tolist()
    )
    assert live.physical_to_logical_map[:2].tolist() == trivial[:2].tolist()
    with pytest.raises(ValueError, match=f"layers must be placement layers in 0..{L - 1}"):
        apply_to_sglang(live, new, layer_ids=list(range(2, L + 2)), ep_rank=1, layers=[L])
    # vLLM
    state = SimpleNamespace(**{k: v.clone() for k, v in vars(to_vllm(old, width=8)).items()})
    apply_to_vllm(state, new, layers=chunk)
    want_new, want_old = to_vllm(new, width=8), to_vllm(old, width=8)
    for name in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"):
        assert torch.equal(getattr(state, name)[chunk], getattr(want_new, name)[chunk])
        assert torch.equal(getattr(state, name)[rest], getattr(want_old, name)[rest])

"""eplb's SGLang adapter against SGLang 0.5.23's released ``ExpertLocationMetadata``: its
constructor, ``init_by_mapping``'s derivation (the a2a cut, the static dispatch table),
``update()`` and ``logical_to_all_physical()``. What is patched for a CPU: see ``sglang_cpu``."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang_cpu import metadata, sglang_args

import eplb
from eplb_engine.adapters import sglang as adapter
from eplb_engine.adapters.sglang import (
    SUPPORTED_SGLANG,
    UnsupportedSglangWarning,
    apply_to_sglang,
    check_sglang_version,
    moe_layer_rows,
    moe_layer_weights,
    rank_dispatch_map,
    to_sglang,
)

TENSORS = (
    "physical_to_logical_map",
    "physical_to_logical_map_cpu",
    "logical_to_all_physical_map",
    "logical_to_all_physical_map_cpu",
    "logical_to_all_physical_map_num_valid",
    "logical_to_rank_dispatch_physical_map",
)


def random_placement(rng: np.random.Generator, topo: eplb.Topology) -> eplb.Placement:
    """Every expert at least once, the spare slots random (some experts single, some many)."""
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return eplb.Placement(rng.permuted(rows, axis=1), topo)


def p2l(placement: eplb.Placement) -> torch.Tensor:
    return torch.from_numpy(placement.phy2log.astype(np.int64))


def same_fields(ours: object, theirs: object) -> list[str]:
    """The fields (tensors and ep_size) where the two metadata differ."""
    bad = [n for n in TENSORS if not _equal(getattr(ours, n), getattr(theirs, n))]
    return bad + (["ep_size"] if ours.ep_size != theirs.ep_size else [])


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


def test_the_installed_sglang_is_a_supported_version():
    import sglang

    assert sglang.__version__ in SUPPORTED_SGLANG
    assert check_sglang_version() == sglang.__version__
    with pytest.warns(UnsupportedSglangWarning, match=r"SGLang 0\.5\.22 is not .*proven on \(0\.5\.23\)"):
        check_sglang_version("0.5.22")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_sglang_version("0.5.23+cpu")


def test_apply_to_sglang_checks_the_running_version_on_sglangs_class(monkeypatch):
    import sglang

    topo = eplb.Topology(2, 4, 6, 3)
    old = eplb.Placement.contiguous(topo)
    with sglang_args(topo):
        live = metadata(p2l(old), 0)
    monkeypatch.setattr(sglang, "__version__", "0.6.0")
    monkeypatch.setattr(adapter, "_checked", {})
    with pytest.warns(UnsupportedSglangWarning, match="SGLang 0.6.0"):
        apply_to_sglang(live, old)
    # a metadata without the fields of 0.5.23 (an older SGLang's: no logical_to_all_physical_map_cpu)
    older = SimpleNamespace(**{k: v for k, v in vars(live).items() if k != "logical_to_all_physical_map_cpu"})
    with pytest.raises(RuntimeError, match="no logical_to_all_physical_map_cpu: not the ExpertLocationMetadata"):
        apply_to_sglang(older, old)


def test_sglangs_constructor_takes_our_maps_and_init_by_mapping_agrees():
    """The defect 'a crash': ExpertLocationMetadata(**maps.fields()) raised TypeError (no
    logical_to_all_physical_map_cpu, ep_size). Now it builds, and equals what SGLang derives
    itself from the same physical_to_logical_map, for a static and a dynamic server."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    rng = np.random.default_rng(0)
    topo = eplb.Topology(3, 8, 12, 4)
    for dispatch in ("static", "dynamic"):
        with sglang_args(topo, ep_dispatch_algorithm=dispatch):
            for _ in range(5):
                placement = random_placement(rng, topo)
                for rank in range(topo.num_gpus):
                    maps = to_sglang(placement, ep_rank=rank, static_dispatch=dispatch == "static")
                    ours = ExpertLocationMetadata(**maps.fields())
                    assert ours.num_local_physical_experts == topo.slots_per_gpu
                    assert same_fields(ours, metadata(p2l(placement), rank)) == [], (dispatch, rank)


@pytest.mark.parametrize("a2a", ["none", "deepep"])
def test_static_dispatch_tables_equal_sglangs_for_2_to_8_ranks(a2a):
    """The defect 'the static dispatch table differs for 3 or more ranks' (33/90 tables at 3
    ranks, 67/120 at 4, 220/240 at 8 before: single-replica experts drew from the generator).
    Every rank's table, over random placements, equals SGLang's own; with an a2a backend the
    table comes from the rank's cut map, as SGLang draws it."""
    rng = np.random.default_rng(1)
    mismatches, tables = 0, 0
    for G in range(2, 9):
        E = 8
        S = E // G + 2
        topo = eplb.Topology(2, E, G * S, G)
        with sglang_args(topo, ep_dispatch_algorithm="static", moe_a2a_backend=a2a):
            for _ in range(6):
                placement = random_placement(rng, topo)
                for rank in range(G):
                    theirs = metadata(p2l(placement), rank).logical_to_rank_dispatch_physical_map
                    ours = rank_dispatch_map(placement, rank, a2a=a2a != "none")
                    mismatches += int(not np.array_equal(ours, theirs.numpy()))
                    tables += 1
    assert tables == 6 * sum(range(2, 9))
    assert mismatches == 0, f"{mismatches} of {tables} tables differ from SGLang's"


@pytest.mark.parametrize("nnodes", [1, 2])
def test_a2a_cut_of_the_map_equals_sglangs(nnodes):
    """With an all-to-all backend SGLang cuts logical_to_all_physical_map per rank to the
    nearest replica (same gpu, else same node when that narrows); to_sglang(a2a=True) writes the
    same map, count and table for every rank, on one node and on two."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    rng = np.random.default_rng(2)
    topo = eplb.Topology(3, 8, 16, 4)
    cut = 0
    with sglang_args(topo, ep_dispatch_algorithm="static", moe_a2a_backend="deepep", nnodes=nnodes):
        assert get_exec().moe.moe_a2a_backend == "deepep" and get_parallel().nnodes == nnodes
        for _ in range(10):
            placement = random_placement(rng, topo)
            for rank in range(topo.num_gpus):
                theirs = metadata(p2l(placement), rank)
                ours = to_sglang(placement, ep_rank=rank, a2a=True, nnodes=nnodes)
                assert same_fields(ours, theirs) == [], rank
                cut += int((ours.logical_to_all_physical_map_num_valid < torch.as_tensor(placement.logcnt)).any())
    assert cut > 0  # the cut did shorten lists
    # without a2a the full lists: they differ from the cut ones
    assert not torch.equal(
        to_sglang(placement, ep_rank=0).logical_to_all_physical_map, ours.logical_to_all_physical_map
    )
    with pytest.raises(ValueError, match="a2a=True cuts logical_to_all_physical_map per rank: pass ep_rank"):
        to_sglang(placement, a2a=True)


@pytest.mark.parametrize("a2a", ["none", "deepep"])
def test_apply_to_sglang_does_what_update_does_host_copies_included(a2a):
    """The defect 'stale maps': apply_to_sglang never wrote logical_to_all_physical_map_cpu, so
    logical_to_all_physical() (what SGLang's weight loader asks) kept the old slots on a GPU,
    where the host copies are tensors of their own. Now SGLang's update(other, layer_ids) and
    apply_to_sglang leave the same metadata, dense rows untouched, and the loader sees the new
    slots."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    rng = np.random.default_rng(3)
    moe = eplb.Topology(2, 8, 12, 3)
    full = moe.with_layers(3)  # row 0 dense, the MoE layers at rows 1, 2
    rows = [1, 2]
    with sglang_args(full, ep_dispatch_algorithm="static", moe_a2a_backend=a2a):
        for _ in range(5):
            old, new = random_placement(rng, full), random_placement(rng, moe)
            for rank in range(3):
                theirs, ours = metadata(p2l(old), rank), metadata(p2l(old), rank)
                assert (
                    theirs.logical_to_all_physical_map_cpu.data_ptr() != theirs.logical_to_all_physical_map.data_ptr()
                )
                target = np.concatenate([old.phy2log[:1], new.phy2log])
                other = ExpertLocationMetadata(
                    **to_sglang(eplb.Placement(target, full), ep_rank=rank, a2a=a2a != "none").fields()
                )
                theirs.update(other, update_layer_ids=rows)
                apply_to_sglang(ours, new, layer_ids=rows, ep_rank=rank, a2a=a2a != "none")
                assert same_fields(ours, theirs) == [], rank
                cut = to_sglang(new, ep_rank=rank, a2a=a2a != "none").logical_to_all_physical_map
                for layer, row in enumerate(rows):
                    for e in range(moe.num_experts):
                        want = [int(p) for p in cut[layer, e] if p >= 0]
                        assert ours.logical_to_all_physical(row, e) == want
                assert ours.physical_to_logical_map_cpu[0].tolist() == old.phy2log[0].tolist()


def test_moe_layer_rows_reads_a_lazy_value_where_sorted_fails():
    """The guide's sorted(model.routed_experts_weights_of_layer) fails on Qwen3-MoE (and
    DeepSeek, GPT-OSS...), where the attribute is SGLang's LazyValue; moe_layer_rows does not."""
    from sglang.srt.utils.common import LazyValue

    weights = {1: [torch.zeros(2, 3)], 3: [torch.ones(2, 3)], 2: [torch.zeros(2, 1)]}
    model = SimpleNamespace(routed_experts_weights_of_layer=LazyValue(lambda: dict(weights)))
    with pytest.raises(KeyError):
        sorted(model.routed_experts_weights_of_layer)
    assert moe_layer_rows(model) == [1, 2, 3]
    got = moe_layer_weights(model)
    assert list(got) == [1, 2, 3] and got[3][0] is weights[3][0]
    assert moe_layer_rows(SimpleNamespace(routed_experts_weights_of_layer=weights)) == [1, 2, 3]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("chunks", [((0, 1), (2,), (3,)), ((2, 3), (0,), (1,))], ids=["ascending", "out-of-order"])
def test_a_chunked_switch_writes_the_rows_sglangs_chunked_update_copies(ranks, chunks):
    """A switch in chunks of MoE rows (a dense row 0 first), static dispatch: SGLang's own
    chunked update (EPLBManager.rebalance: update(target, update_layer_ids=chunk) per chunk,
    the target built by init_by_mapping over the whole target map) against apply_to_sglang
    with the mixed routing map of each chunk and target= the version switched to: every field
    equal after every chunk, on every rank. Drawn over the mixed map instead (no target=), the
    table's rows agree while the chunks go in ascending layer order (as MoverApplier's do:
    SGLang's fair draw runs over the rows in order, and a row's draws depend only on the rows
    before it, all switched) and, on 4 ranks, differ out of order."""
    moe = eplb.Topology(4, 8, 4 * ranks, ranks)
    model_topo = moe.with_layers(5)
    rows = [1, 2, 3, 4]
    rng = np.random.default_rng(ranks)
    bad, drawn_over_mixed = [], 0
    for _ in range(12):
        old, new = random_placement(rng, model_topo), random_placement(rng, moe)
        full_new = eplb.Placement(np.concatenate([old.phy2log[:1], new.phy2log]), model_topo)
        for rank in range(ranks):
            with sglang_args(model_topo, ep_dispatch_algorithm="static"):
                theirs, ours, mixed = metadata(p2l(old), rank), metadata(p2l(old), rank), metadata(p2l(old), rank)
                target = metadata(p2l(full_new), rank)  # SGLang's own derivation of the whole target
            routing = old.phy2log[1:].copy()
            for chunk in chunks:
                routing[list(chunk)] = new.phy2log[list(chunk)]
                step = eplb.Placement(routing.copy(), moe)
                theirs.update(target, update_layer_ids=[rows[i] for i in chunk])
                apply_to_sglang(ours, step, layer_ids=rows, ep_rank=rank, layers=chunk, target=new)
                apply_to_sglang(mixed, step, layer_ids=rows, ep_rank=rank, layers=chunk)
                bad += [(rank, chunk, f) for f in same_fields(ours, theirs)]
                drawn_over_mixed += int(bool(same_fields(mixed, theirs)))
    assert bad == []
    if chunks[0] == (0, 1):
        assert drawn_over_mixed == 0
    elif ranks == 4:  # on 2 ranks a rank lacks at most one pick: the draws use the generator alike
        assert drawn_over_mixed > 0

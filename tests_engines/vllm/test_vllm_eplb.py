"""eplb's vLLM adapter against vLLM's released EPLB classes (``EplbState``, ``EplbModelState``,
``add_model``, ``step``, ``rearrange``, ``_commit_eplb_maps``, ``compute_logical_maps``) on two
gloo ranks. The CPU refusals vLLM makes are patched in the tests only: see ``vllm_world``."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from vllm_world import GUIDE_EPLB, coded, cpu_streams, fake_moe, model_config, run_ranks, state_key, vllm_world

import eplb
from eplb_engine.adapters.vllm import (
    SUPPORTED_VLLM,
    UnsupportedVllmWarning,
    apply_to_vllm,
    check_vllm_version,
    last_step_loads,
    take_over,
    to_vllm,
    vllm_expert_loads,
    vllm_release,
)

L, E, R = 2, 8, 4  # MoE layers, experts, redundant slots: P = 12 over 2 ranks


def slot_tokens(layer: int, step: int, physical: int) -> torch.Tensor:
    """``[P]`` tokens one pass sends to each slot: different per layer, step and slot."""
    return (torch.arange(physical) * (layer + 1) + 3 * step + 1).to(torch.int32)


def test_the_installed_vllm_is_a_supported_version():
    import vllm

    assert check_vllm_version() == vllm.__version__
    assert vllm.__version__ in SUPPORTED_VLLM
    with pytest.warns(UnsupportedVllmWarning, match=r"vLLM 0\.31\.0 is not .*0\.32\.0, 0\.33\.0, 0\.34\.0"):
        check_vllm_version("0.31.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"


def test_the_release_under_test_is_the_one_imported():
    """The pinned 0.32.0 (engines/vllm/requirements.txt), or, in the stage's overlay run, the
    later release's EPLB files first on the path (EPLB_ENGINE_OVERLAY = version:folder): the
    version read through the ``vllm`` module, and EplbState's source from the overlay."""
    from pathlib import Path

    import vllm
    import vllm.distributed.eplb.eplb_state as eplb_state

    overlay = os.environ.get("EPLB_ENGINE_OVERLAY")
    pinned = (Path(__file__).parents[2] / "engines" / "vllm" / "requirements.txt").read_text().split("==")[1].strip()
    version, folder = overlay.split(":", 1) if overlay else (pinned, "site-packages")
    assert vllm.__version__ == version
    assert check_vllm_version() == version
    where = Path(eplb_state.__file__)
    assert (where.is_relative_to(folder) and not where.is_symlink()) if overlay else folder in where.parts


def _record(rank: int, world: int, port: int, hand_over: bool, eplb_config: dict) -> dict:
    with vllm_world(rank, world, port, **eplb_config) as parallel:
        from vllm.distributed.eplb.eplb_state import EplbState

        state = EplbState(parallel, torch.device("cpu"))
        model = fake_moe(L, E, eplb_config["num_redundant_experts"], world, rank)
        state.add_model(model, model_config())
        if hand_over:
            take_over(state)
        ms = next(iter(state.model_states.values()))
        p2l_before = ms.physical_to_logical_map.clone()
        P = model.num_physical_experts
        seen = []
        for step in range(5):
            for layer, moe in enumerate(model.moe_layers):
                moe.route(slot_tokens(layer, step, P))
            state.step()
            seen.append(last_step_loads(state, ms).tolist())
        return {
            "seen": seen,
            "window_total": int(ms.expert_load_window.sum()),
            "map_unchanged": bool(torch.equal(ms.physical_to_logical_map, p2l_before)),
        }


def _expected(P: int) -> list:
    return [[slot_tokens(layer, step, P).tolist() for layer in range(L)] for step in range(5)]


def test_released_step_records_nothing_under_the_guides_config():
    """The defect 'vLLM: no loads': with the guide's --eplb-config the released step() never
    writes the window (recording waits for a rearrangement ~5e8 steps away)."""
    out = run_ranks(_record, 2, False, GUIDE_EPLB)
    assert out[0]["window_total"] == out[1]["window_total"] == 0


def test_take_over_records_every_pass_and_vllm_never_rearranges():
    """take_over: the guide's config records each pass (the row last_step_loads returns is the
    pass routed); with step_interval=2, where vLLM would rearrange at step 2, the map stays."""
    for config in (GUIDE_EPLB, {"num_redundant_experts": R, "window_size": 3, "step_interval": 2}):
        out = run_ranks(_record, 2, True, config)
        P = E + config["num_redundant_experts"]
        for rank in (0, 1):
            assert out[rank]["seen"] == _expected(P), config
            assert out[rank]["map_unchanged"], config


class _Target:
    """An EPLB policy (vLLM's interface) that returns a fixed map and keeps what vLLM gave it."""

    target: torch.Tensor
    seen: list = []

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_gpus, old_global_expert_indices=None):
        cls.seen.append(weight.clone())
        return cls.target.clone()


def _rearrange(rank: int, world: int, port: int, seed: int) -> dict:
    config = {"num_redundant_experts": R, "window_size": 4, "step_interval": 12, "use_async": False}
    with vllm_world(rank, world, port, **config) as parallel, cpu_streams():
        import torch.distributed as dist
        from vllm.distributed.eplb.eplb_state import EplbState, compute_logical_maps

        from eplb_engine.mover import WeightMover

        state = EplbState(parallel, torch.device("cpu"))
        model = fake_moe(L, E, R, world, rank)
        state.add_model(model, model_config())
        ms = next(iter(state.model_states.values()))
        P, S = model.num_physical_experts, model.num_local_physical_experts
        topo = eplb.Topology(L, E, P, world)
        old = eplb.Placement(ms.physical_to_logical_map.numpy().copy(), topo)
        rng = np.random.default_rng(seed)
        rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
        new = eplb.Placement(rng.permuted(rows, axis=1), topo)
        _Target.target, _Target.seen = torch.from_numpy(new.phy2log.astype(np.int64)), []
        state.policy = _Target

        # Our copy of the weights, moved by WeightMover over the same gloo world.
        ours = [{f"t{i}": t.clone() for i, t in enumerate(per_layer)} for per_layer in model.expert_weights]
        # Three passes; vLLM starts 3/4 into its interval (9 of 12), so it rearranges at the third step.
        for step in range(3):
            for layer, moe in enumerate(model.moe_layers):
                moe.route(slot_tokens(layer, step, P) * (rank + 1))
            if step < 2:
                state.step()
        window_before = ms.expert_load_window.clone()
        ours_loads = vllm_expert_loads(window_before, ms.physical_to_logical_map, E)
        state.step()  # records step 2, then rearranges (vLLM's folding, all-reduce, policy, move, commit)
        assert len(_Target.seen) == 1
        WeightMover(ours, old, new).run()
        dist.barrier()

        # vLLM's derivation of the maps, and ours written in place into a copy of the old state.
        l2p, count = compute_logical_maps(torch.from_numpy(new.phy2log.astype(np.int64)), E)
        copy = type("S", (), {})()
        want = to_vllm(old, width=ms.logical_to_physical_map.shape[-1])
        copy.physical_to_logical_map = want.physical_to_logical_map.clone()
        copy.logical_to_physical_map = want.logical_to_physical_map.clone()
        copy.logical_replica_count = want.logical_replica_count.clone()
        apply_to_vllm(copy, new)
        return {
            "vllm_fold": _Target.seen[0].tolist(),
            "our_fold": ours_loads.tolist(),
            "window_last": ms.expert_load_window[2].tolist(),
            "p2l": ms.physical_to_logical_map.tolist(),
            "l2p": ms.logical_to_physical_map.tolist(),
            "count": ms.logical_replica_count.tolist(),
            "l2p_derived": l2p.tolist(),
            "count_derived": count.tolist(),
            "ours_maps": [copy.physical_to_logical_map.tolist(), copy.logical_to_physical_map.tolist()],
            "ours_count": copy.logical_replica_count.tolist(),
            "new": new.phy2log.tolist(),
            "vllm_weights": [[t.tolist() for t in per_layer] for per_layer in model.expert_weights],
            "our_weights": [[ours[layer][f"t{i}"].tolist() for i in range(2)] for layer in range(L)],
            "coded_new": [
                [coded(layer, torch.tensor(new.phy2log[layer, rank * S : (rank + 1) * S]), w).tolist() for w in (4, 2)]
                for layer in range(L)
            ],
        }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adapter_matches_vllms_rearrangement_maps_loads_and_weights(seed):
    """One real rearrangement (sync mode, vLLM's gloo communicator, a policy that returns a
    random map): vLLM's own load folding + all-reduce equals the sum over ranks of
    vllm_expert_loads; its committed maps equal apply_to_vllm's and to_vllm's; the weights
    WeightMover writes equal those vLLM's rearrange_expert_weights_inplace wrote."""
    out = run_ranks(_rearrange, 2, seed)
    # vLLM's window at the rearrangement holds the 3 passes; ours was read before the third:
    # add it (the row step 2 wrote) folded under the old map, which it was routed with.
    for rank in (0, 1):
        r = out[rank]
        assert r["p2l"] == r["new"]
        assert r["ours_maps"][0] == r["new"]
        assert r["l2p"] == r["ours_maps"][1]
        assert [row[: len(r["l2p_derived"][0][0])] for layer in r["l2p"] for row in layer] == [
            row for layer in r["l2p_derived"] for row in layer
        ]
        assert r["count"] == r["count_derived"] == r["ours_count"]
        assert r["vllm_weights"] == r["our_weights"] == r["coded_new"]
    assert out[0]["vllm_fold"] == out[1]["vllm_fold"]
    old_p2l = torch.tensor([list(range(E)) + [i % E for i in range(R)]] * L)
    total = np.zeros((L, E))
    for rank in (0, 1):
        last = torch.tensor(out[rank]["window_last"], dtype=torch.int32)[None]
        total += np.array(out[rank]["our_fold"]) + vllm_expert_loads(last, old_p2l, E)
    assert out[0]["vllm_fold"] == total.tolist()


# A map with a gpu down: gpu 1's slots empty (-1) in every layer, the experts on gpu 0's.
DOWN_E, DOWN_R = 4, 8  # P = 12 over 2 gpus: 6 live slots hold the 4 experts and 2 replicas


def _down_map() -> np.ndarray:
    live = np.array([[0, 1, 2, 3, 1, 3], [3, 2, 1, 0, 0, 2]])
    return np.concatenate([live, np.full((L, 6), -1)], axis=1)


def _gpu_down(rank: int, world: int, port: int) -> dict:
    config = {"num_redundant_experts": DOWN_R, "window_size": 4, "step_interval": 3, "use_async": False}
    with vllm_world(rank, world, port, **config) as parallel, cpu_streams():
        from vllm.distributed.eplb.eplb_state import EplbState, compute_logical_maps

        from eplb_engine.balanced_rank import fold_slot_counts

        state = EplbState(parallel, torch.device("cpu"))
        model = fake_moe(L, DOWN_E, DOWN_R, world, rank)
        state.add_model(model, model_config())
        ms = next(iter(state.model_states.values()))
        P = model.num_physical_experts
        down = eplb.Placement(_down_map(), eplb.Topology(L, DOWN_E, P, 2))
        assert down.down_gpus == (1,)
        apply_to_vllm(ms, down)  # eplb's commit of the map, into vLLM's live tensors
        ours = [t.clone() for t in (ms.physical_to_logical_map, ms.logical_to_physical_map, ms.logical_replica_count)]
        # vLLM's own commit of a -1 map (update_mapping: elastic EP's, compute_logical_maps inside).
        state.update_mapping(model_config(), torch.from_numpy(_down_map()))
        l2p, count = compute_logical_maps(torch.from_numpy(_down_map()), DOWN_E)
        # A pass that sends tokens to the empty slots too: vLLM's fold drops those, so must ours.
        tokens = [slot_tokens(layer, 0, P) for layer in range(L)]
        for layer, moe in enumerate(model.moe_layers):
            moe.route(tokens[layer])
        _Target.target, _Target.seen = torch.from_numpy(_down_map()), []
        state.policy = _Target
        window = torch.zeros_like(ms.expert_load_window)
        window[0] = torch.stack(tokens)
        slot_counts = torch.stack(tokens)
        return {
            "ours": [t.tolist() for t in ours],
            "vllm": [
                t.tolist() for t in (ms.physical_to_logical_map, ms.logical_to_physical_map, ms.logical_replica_count)
            ],
            "derived": [l2p.tolist(), count.tolist()],
            "to_vllm_width": to_vllm(down).logical_to_physical_map.shape[-1],
            "live_width": ms.logical_to_physical_map.shape[-1],
            "our_fold": vllm_expert_loads(window, ms.physical_to_logical_map, DOWN_E).tolist(),
            "fold_torch": fold_slot_counts(slot_counts.double(), down).tolist(),
            "fold_numpy": fold_slot_counts(slot_counts.double().numpy(), down).tolist(),
            "live_tokens": [
                [int(t[: P // 2][_down_map()[layer, : P // 2] == e].sum()) for e in range(DOWN_E)]
                for layer, t in enumerate(tokens)
            ],
        } | _rearranged(state, ms)


def _rearranged(state: object, ms: object) -> dict:
    """vLLM's rearrangement from the -1 map to itself (step_interval 3, vLLM starting at 3: at
    the first step): its own fold of the window under that map, and the map it commits."""
    state.step()
    return {
        "vllm_fold": _Target.seen[0].tolist() if _Target.seen else None,
        "p2l_after": ms.physical_to_logical_map.tolist(),
    }


def test_a_map_with_a_gpu_down_commits_and_folds_as_vllms_own():
    """A survivor map (gpu 1's slots -1, as vLLM's fault-tolerance maps mark them): apply_to_vllm
    writes what vLLM's own commit of that map writes (update_mapping, compute_logical_maps):
    the -1 slots in physical_to_logical_map, absent from logical_to_physical_map and the counts.
    Loads recorded on the empty slots are dropped by vllm_expert_loads and fold_slot_counts as
    vLLM's rearrangement drops them."""
    both = run_ranks(_gpu_down, 2)
    out = both[0]
    assert out["ours"][0] == out["vllm"][0] == _down_map().tolist()
    assert out["ours"][1] == out["vllm"][1]
    width = len(out["derived"][0][0][0])
    assert [row[:width] for layer in out["ours"][1] for row in layer] == [
        row for layer in out["derived"][0] for row in layer
    ]
    assert out["ours"][2] == out["vllm"][2] == out["derived"][1]
    assert out["to_vllm_width"] == out["live_width"] == _WIDTHS[_version()](DOWN_R)
    assert out["our_fold"] == out["fold_torch"] == out["fold_numpy"] == out["live_tokens"]
    # vLLM's fold all-reduces over the 2 ranks, which routed the same pass
    assert out["vllm_fold"] == both[1]["vllm_fold"] == (2 * np.array(out["our_fold"])).tolist()
    assert out["p2l_after"] == both[1]["p2l_after"] == _down_map().tolist()


def _version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


# logical_to_physical_map's width per release, for a model of R redundant slots (elastic EP off):
# vLLM's MAX_EXPERT_REDUNDANCY + 1 up to 0.33.0, num_redundant_experts + 1 from 0.34.0.
_WIDTHS = {"0.32.0": lambda r: 1024, "0.33.0": lambda r: 1024, "0.34.0": lambda r: r + 1}


def _built(rank: int, world: int, port: int) -> dict:
    """What ``add_model`` built: the maps' width, the key it filed the state under."""
    with vllm_world(rank, world, port, **GUIDE_EPLB) as parallel:
        from vllm.distributed.eplb.eplb_state import EplbState

        state = EplbState(parallel, torch.device("cpu"))
        config = model_config()
        state.add_model(fake_moe(L, E, GUIDE_EPLB["num_redundant_experts"], world, rank), config)
        ms = next(iter(state.model_states.values()))
        placement = eplb.Placement(ms.physical_to_logical_map.numpy().copy(), eplb.Topology(L, E, E + 32, world))
        maps = to_vllm(placement)
        return {
            "keys": list(state.model_states),
            "state_key": state_key(config),
            "width": ms.logical_to_physical_map.shape[-1],
            "release_width": vllm_release().map_width(GUIDE_EPLB["num_redundant_experts"]),
            "to_vllm_equal": all(
                torch.equal(getattr(maps, name), getattr(ms, name))
                for name in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count")
            ),
        }


def test_each_release_builds_the_map_width_and_state_key_the_adapter_expects():
    """vLLM 0.34.0 sizes logical_to_physical_map by the model's redundant slots (33 for the
    guide's 32; 1024 before) and files the state under hash_config_cached(model_config) (a
    SHA-256 of compile_factors(); compute_hash() before): to_vllm's default width is the live
    one on each release, and the drop-in finds the state whatever its key."""
    import hashlib
    import json

    out = run_ranks(_built, 2)[0]
    version = _version()
    assert out["width"] == out["release_width"] == _WIDTHS[version](32)
    assert out["to_vllm_equal"]
    sha = hashlib.sha256(json.dumps({"model": "fake-moe"}, sort_keys=True).encode()).hexdigest()
    want_key = {"0.32.0": "fake-moe", "0.33.0": "fake-moe", "0.34.0": sha}[version]
    assert out["keys"] == [want_key] == [out["state_key"]]


def _recording_after_a_write_elsewhere(rank: int, world: int, port: int) -> dict:
    """vLLM's step records (every step lies within the window before a rearrangement), so
    the last value it wrote is True; a write elsewhere turns the layers' recording off, as
    0.34.0's EPLBController.suppress does around a warmup pass; then take_over."""
    config = {"num_redundant_experts": R, "window_size": 1000, "step_interval": 100}
    with vllm_world(rank, world, port, **config) as parallel:
        from vllm.distributed.eplb.eplb_state import EplbState

        state = EplbState(parallel, torch.device("cpu"))
        model = fake_moe(L, E, R, world, rank)
        state.add_model(model, model_config())
        state.step()
        written_before = state.__dict__.get("_should_record_value", "absent")
        state.should_record_tensor.fill_(False)
        take_over(state)
        on_after_take_over = bool(state.should_record_tensor)
        ms = next(iter(state.model_states.values()))
        P = model.num_physical_experts
        for layer, moe in enumerate(model.moe_layers):
            moe.route(slot_tokens(layer, 7, P))
        state.step()
        return {
            "written_before": written_before,
            "on_after_take_over": on_after_take_over,
            "on_after_step": bool(state.should_record_tensor),
            "recorded": last_step_loads(state, ms).tolist(),
            "want": [slot_tokens(layer, 7, P).tolist() for layer in range(L)],
        }


def test_take_over_switches_recording_on_after_a_write_vllm_did_not_track():
    """0.34.0 writes should_record_tensor only when the value differs from the last it wrote
    (_should_record_value): take_over must still switch the layers' recording on when a write
    elsewhere turned it off behind that value. Without forgetting the value, 0.34.0's update
    skips the write and the pass is not recorded."""
    out = run_ranks(_recording_after_a_write_elsewhere, 2)
    version = _version()
    for rank in (0, 1):
        got = out[rank]
        assert got["written_before"] == (True if vllm_release().tracks_should_record else "absent"), got
        assert vllm_release().tracks_should_record == (version == "0.34.0")
        assert got["on_after_take_over"] and got["on_after_step"], got
        assert got["recorded"] == got["want"], got

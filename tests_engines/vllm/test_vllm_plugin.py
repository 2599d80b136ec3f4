"""The vLLM drop-in (``eplb_engine.adapters.vllm_plugin``) through vLLM's own plugin loading:
the ``vllm.general_plugins`` entry point is found by ``load_general_plugins()``, and with
``EPLB_ADDRESSES`` set vLLM's real ``EplbState`` follows a real eplb service through a re-plan
on two gloo ranks. CPU patches as in ``vllm_world`` (tests only)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
from vllm_world import coded, cpu_streams, fake_moe, model_config, run_ranks, state_key, vllm_world

L, E, R = 2, 8, 4  # MoE layers, experts, redundant slots: P = 12 over 2 ranks
HOT = 7


def test_the_entry_point_is_declared_for_vllms_plugin_group():
    found = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "eplb"]
    assert [ep.value for ep in found] == ["eplb_engine.adapters.vllm_plugin:register"]


def _loaded(rank: int, world: int, port: int, addresses: str) -> dict:
    """vLLM's plugin loading in a fresh process: without EPLB_ADDRESSES nothing changes; with
    it, EplbState's add_model and step are eplb's."""
    if addresses:
        os.environ["EPLB_ADDRESSES"] = addresses
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return {
        "installed": bool(EplbState.__dict__.get("_eplb_installed")),
        "step": EplbState.step.__qualname__,
    }


def test_vllms_plugin_loading_installs_the_drop_in_only_when_addresses_are_set():
    assert run_ranks(_loaded, 1, "")[0] == {"installed": False, "step": "EplbState.step"}
    got = run_ranks(_loaded, 1, "127.0.0.1:1")[0]
    assert got["installed"] and "eplb_step" in got["step"]


def _drop_in(rank: int, world: int, port: int, address: str) -> dict:
    os.environ["EPLB_ADDRESSES"] = address
    os.environ["EPLB_DEPLOYMENT"] = "vllm-drop-in"
    config = {"num_redundant_experts": R, "window_size": 10, "step_interval": 2147483647}
    with vllm_world(rank, world, port, **config) as parallel, cpu_streams():
        import torch.distributed as dist
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.plugins import load_general_plugins

        from eplb_engine.client import ServiceClient

        load_general_plugins()  # vLLM's own discovery: the entry point installs the drop-in
        state = EplbState(parallel, torch.device("cpu"))
        model = fake_moe(L, E, R, world, rank)
        state.add_model(model, model_config())  # eplb's add_model: take_over; wired at the first step
        assert not state.__dict__.get("_eplb_ranks")
        state.step(is_dummy=True)  # the first step wires this rank (vLLM's first steps are dummy runs)
        ms = next(iter(state.model_states.values()))
        ours = next(iter(state._eplb_ranks.values()))
        P, S = model.num_physical_experts, model.num_local_physical_experts
        client = ServiceClient(address)
        deadline, step, forced = time.monotonic() + 60, 0, False
        while True:
            # Expert HOT is hot: every token goes to its replicas (vLLM's map, as routed now).
            for layer, moe in enumerate(model.moe_layers):
                tokens = torch.zeros(P, dtype=torch.int32)
                slots = ms.logical_to_physical_map[layer, HOT]
                slots = slots[slots >= 0]
                tokens[slots] = 100 // len(slots)
                tokens[:E] += 1
                moe.route(tokens)
            state.step()  # vLLM's step, then the pass reported and the rollout's step boundary
            step += 1
            if step == 6:
                assert ours.reporter.flush(10)
                dist.barrier()
                if rank == 0:
                    forced = client.rebalance("vllm-drop-in", force=True).published
            done = torch.tensor([int(ours.rollout.current.version >= 2 or time.monotonic() > deadline)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
            time.sleep(0.01)
        new = ours.rollout.current.placement
        result = {
            "version": ours.rollout.current.version,
            "forced": forced,
            "accepted": ours.reporter.stats().accepted,
            "replicas_of_hot": int(new.logcnt[:, HOT].min()),
            "p2l_is_new": ms.physical_to_logical_map.tolist() == new.phy2log.tolist(),
            "weights_are_new": all(
                torch.equal(
                    model.expert_weights[layer][i],
                    coded(layer, torch.from_numpy(new.phy2log[layer, rank * S : (rank + 1) * S].copy()), w),
                )
                for layer in range(L)
                for i, w in enumerate((4, 2))
            ),
            "window_total": int(ms.expert_load_window.sum()),
        }
        state.__dict__["_eplb_ranks"].clear()
        ours.close()
        client.close()
        return result


def test_drop_in_follows_a_real_service_through_a_replan():
    """End to end through vLLM's plugin loading: rank 0 creates the deployment from vLLM's map,
    both ranks report every pass (vLLM's window is per rank), a forced re-plan gives the hot
    expert more replicas, and both ranks end on version 2 with vLLM's maps and the expert
    weights moved to it, vLLM never rearranging on its own."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))  # the service harness
    from svc_thread import ServerThread

    server = ServerThread().start()
    try:
        out = run_ranks(_drop_in, 2, server.address)
    finally:
        server.stop()
    assert out[0]["forced"], out
    for rank in (0, 1):
        got = out[rank]
        assert got["version"] == 2 and got["accepted"] > 0, got
        assert got["replicas_of_hot"] > 1 and got["p2l_is_new"] and got["weights_are_new"], got
        assert got["window_total"] > 0, got


def _refused(rank: int, world: int, port: int, address: str) -> str:
    os.environ["EPLB_ADDRESSES"] = address
    os.environ["EPLB_DEPLOYMENT"] = "vllm-elsewhere"
    config = {"num_redundant_experts": R, "window_size": 10, "step_interval": 2147483647}
    with vllm_world(rank, world, port, **config) as parallel, cpu_streams():
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        state = EplbState(parallel, torch.device("cpu"))
        state.add_model(fake_moe(L, E, R, world, rank), model_config())
        try:
            state.step(is_dummy=True)  # the first step wires the model
        except RuntimeError as exc:
            return str(exc)
        return "started"


def test_drop_in_refuses_a_deployment_whose_placement_is_not_vllms_map():
    """A deployment already at another placement (vLLM starts from its own default map, which
    the service's version does not describe): every rank refuses at its first step (where the drop-in wires), saying what to
    do, instead of moving weights and folding loads with a map vLLM does not route with."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
    import numpy as np
    from svc_thread import ServerThread

    import eplb
    from eplb_engine.client import ServiceClient

    server = ServerThread().start()
    try:
        topo = eplb.Topology(L, E, E + R, 2)
        reversed_map = np.tile(np.array([*range(E - 1, -1, -1), *range(R)]), (L, 1))
        with ServiceClient(server.address) as client:
            client.create_deployment("vllm-elsewhere", topo, initial=eplb.Placement(reversed_map, topo))
        out = run_ranks(_refused, 2, server.address)
    finally:
        server.stop()
    for rank in (0, 1):
        assert "is not the map vLLM serves" in out[rank] and "EPLB_DEPLOYMENT" in out[rank], out


# The draft's MoE layers (experts and slots: vLLM's EplbState.validate_ep_configuration wants
# every model it holds to have the target's expert counts) and its hot expert.
DL, DHOT = 1, 3


def _hot_pass(model: object, ms: object, hot: int) -> None:
    """One pass's routing: every token to expert ``hot``'s replicas (vLLM's map, as routed now)."""
    P, E_ = model.num_physical_experts, model.num_logical_experts
    for layer, moe in enumerate(model.moe_layers):
        tokens = torch.zeros(P, dtype=torch.int32)
        slots = ms.logical_to_physical_map[layer, hot]
        slots = slots[slots >= 0]
        tokens[slots] = 100 // len(slots)
        tokens[:E_] += 1
        moe.route(tokens)


def _with_draft(rank: int, world: int, port: int, address: str) -> dict:
    os.environ["EPLB_ADDRESSES"] = address
    os.environ["EPLB_DEPLOYMENT"] = "vllm-target"
    config = {"num_redundant_experts": R, "window_size": 10, "step_interval": 2147483647}
    with vllm_world(rank, world, port, **config) as parallel, cpu_streams():
        import torch.distributed as dist
        from vllm.distributed.eplb.eplb_state import EplbState
        from vllm.plugins import load_general_plugins

        from eplb_engine.client import ServiceClient

        load_general_plugins()
        state = EplbState(parallel, torch.device("cpu"))
        # As GPUModelRunner.load_model: the draft first, named by eplb_draft_model_name, then the target.
        draft, target = fake_moe(DL, E, R, world, rank), fake_moe(L, E, R, world, rank)
        draft_config, target_config = model_config("fake-draft"), model_config()
        state.add_model(draft, draft_config, model_name=f"{draft_config.model} (draft)")  # eplb_draft_model_name
        state.add_model(target, target_config)
        ms, dms = state.model_states[state_key(target_config)], state.model_states[state_key(draft_config)]
        client = ServiceClient(address)
        deadline, step, forced = time.monotonic() + 60, 0, []
        while True:
            _hot_pass(target, ms, HOT)
            _hot_pass(draft, dms, DHOT)
            state.step()
            step += 1
            ours = next(iter(state._eplb_ranks.values()))
            if step == 6:
                for part in ours.parts:
                    assert part.reporter.flush(10)
                dist.barrier()
                if rank == 0:
                    forced = [client.rebalance(d, force=True).published for d in ("vllm-target", "vllm-target-draft-1")]
                dist.barrier()
                # Both new versions reach every rank before the next boundary: each is then
                # in flight or offered while the other prepares, so neither switches alone.
                assert all(part.watcher.wait_for(2, 10) for part in ours.parts)
                dist.barrier()
            versions = [part.rollout.current.version for part in ours.parts]
            done = torch.tensor([int(min(versions) >= 2 or time.monotonic() > deadline)])
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
            time.sleep(0.01)
        S, DS = target.num_local_physical_experts, draft.num_local_physical_experts
        result = {
            "wired": len(state._eplb_ranks),
            "deployments": [part.deployment for part in ours.parts],
            "forced": forced,
            "versions": [part.rollout.current.version for part in ours.parts],
            "events": [[(e.kind, e.version, e.step) for e in part.rollout.events] for part in ours.parts],
            "accepted": [part.reporter.stats().accepted for part in ours.parts],
            "maps_are_new": [
                m.physical_to_logical_map.tolist() == part.rollout.current.placement.phy2log.tolist()
                for m, part in zip((ms, dms), ours.parts)
            ],
            "weights_are_new": all(
                torch.equal(
                    model.expert_weights[layer][i],
                    coded(layer, torch.from_numpy(new.phy2log[layer, rank * s : (rank + 1) * s].copy()), w),
                )
                for model, new, s in (
                    (target, ours.target.rollout.current.placement, S),
                    (draft, ours.draft.rollout.current.placement, DS),
                )
                for layer in range(model.num_moe_layers)
                for i, w in enumerate((4, 2))
            ),
            "draft_replicas_of_hot": int(ours.draft.rollout.current.placement.logcnt[:, DHOT].min()),
        }
        state.__dict__["_eplb_ranks"].clear()
        ours.close()
        client.close()
        return result


def test_drop_in_switches_a_draft_with_its_target_at_the_same_step():
    """vLLM's speculative decoding adds the draft's MoE model (``model_name`` ending in
    " (draft)") to the same ``EplbState`` before the target: the drop-in wires both at the first
    step as one ``BalancedRank`` (the target's deployment from ``EPLB_DEPLOYMENT``, the draft's
    ``-draft-1``: own experts, slots, loads and versions), and when both are re-planned at once
    both switch, with vLLM's maps and the weights, at one step, the same on every rank."""
    # vLLM's draft name, read from its source (importing eplb_utils pulls in the model loader,
    # whose imports the CPU test venv lacks): the name the drop-in tells a draft by.
    utils = Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "worker" / "gpu" / "eplb_utils.py"
    assert 'return f"{model_config.model} (draft)"' in utils.read_text()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))
    from svc_thread import ServerThread

    server = ServerThread().start()
    try:
        out = run_ranks(_with_draft, 2, server.address)
    finally:
        server.stop()
    assert out[0]["forced"] == [True, True], out
    steps = set()
    for rank in (0, 1):
        got = out[rank]
        assert got["wired"] == 1 and got["deployments"] == ["vllm-target", "vllm-target-draft-1"], got
        assert got["versions"] == [2, 2] and min(got["accepted"]) > 0, got
        assert got["maps_are_new"] == [True, True] and got["weights_are_new"], got
        assert got["draft_replicas_of_hot"] > 1, got
        target_events, draft_events = got["events"]
        assert [e[:2] for e in target_events] == [("switched", 2)], got
        assert [e[:2] for e in draft_events] == [("switched", 2)], got
        assert target_events[0][2] == draft_events[0][2], got  # one step for both
        steps.add(target_events[0][2])
    assert len(steps) == 1, out  # and the same step on both ranks

"""Every array or tensor an engine adapter returns is contiguous, so that a caller's
``t = torch.as_tensor(result); dist.all_reduce(t)`` reduces it. gloo reduces a tensor's storage
as if it were contiguous: a strided view (a column slice) comes back with wrong values and no
error. Each result is all-reduced over two real gloo processes here, against the sum computed in
the test process."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from gloo_ranks import spawn_ranks

import eplb
from eplb_engine.adapters.sglang import rank_dispatch_map, rank_physical_map, sglang_expert_loads, to_sglang
from eplb_engine.adapters.vllm import last_step_loads, to_vllm, vllm_expert_loads, vllm_slot_loads

L, E, P, G = 2, 4, 6, 2


def _placement(rank: int) -> eplb.Placement:
    """A different placement per rank (both valid), so that the sum tells the ranks apart."""
    rows = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]] if rank == 0 else [[0, 1, 2, 3, 2, 3], [0, 0, 1, 2, 3, 1]]
    return eplb.Placement(np.array(rows), eplb.Topology(L, E, P, G))


def _window(rank: int) -> torch.Tensor:
    """int32 ``[W, L, P]`` load window, different per rank."""
    return (torch.arange(3 * L * P, dtype=torch.int32).reshape(3, L, P) + 1) * (rank + 1)


def adapter_results(rank: int) -> dict[str, object]:
    """Each adapter function's arrays and tensors as rank ``rank`` gets them. The recorder's
    ``logical_count`` is given as SGLang may hand it: a float64 view, here ``[L, E]`` columns of
    a wider buffer."""
    placement = _placement(rank)
    window = _window(rank)
    vllm_maps = to_vllm(placement, width=P)
    sglang_maps = to_sglang(placement, ep_rank=rank)
    eplb_state = SimpleNamespace(expert_load_window_step=2, expert_load_window_size=3)
    buffer = torch.arange(L * (E + 3), dtype=torch.float64).reshape(L, E + 3) * (rank + 1)
    return {
        **{f"to_vllm.{k}": v for k, v in vars(vllm_maps).items()},
        **{f"to_sglang.{k}": v for k, v in sglang_maps.fields().items() if isinstance(v, torch.Tensor)},
        "rank_physical_map": rank_physical_map(placement),
        "rank_physical_map(a2a)": rank_physical_map(placement, rank),
        "rank_dispatch_map": rank_dispatch_map(placement, rank),
        "vllm_slot_loads": vllm_slot_loads(window),
        "vllm_expert_loads": vllm_expert_loads(window, torch.tensor(placement.phy2log), E),
        "last_step_loads": last_step_loads(eplb_state, SimpleNamespace(expert_load_window=window)),
        "sglang_expert_loads": sglang_expert_loads(buffer[:, :E]),
        "sglang_expert_loads(layer_ids)": sglang_expert_loads(buffer[:, :E], [1, 0]),
    }


def _reduce_each(rank: int) -> dict[str, list]:
    out = {}
    for name, result in adapter_results(rank).items():
        t = torch.as_tensor(result)  # the caller's way: no copy of a strided array
        dist.all_reduce(t)
        out[name] = t.tolist()
    return out


def test_every_adapter_result_is_contiguous() -> None:
    for name, result in adapter_results(0).items():
        flags = result.flags["C_CONTIGUOUS"] if isinstance(result, np.ndarray) else result.is_contiguous()
        assert flags, name


def test_every_adapter_result_all_reduces_over_two_gloo_ranks() -> None:
    """Before: vllm_expert_loads (a column slice of its fold) and sglang_expert_loads (the
    recorder's view, unchanged) came back strided and reduced to wrong values, silently."""
    want = {
        name: (torch.as_tensor(np.asarray(a)) + torch.as_tensor(np.asarray(b))).tolist()
        for (name, a), b in zip(adapter_results(0).items(), adapter_results(1).values())
    }
    for got in spawn_ranks(_reduce_each, 2):
        assert isinstance(got, dict), got
        assert {name: got[name] for name in want} == want

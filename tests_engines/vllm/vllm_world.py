"""vLLM's real EPLB classes on CPU ranks, for the engine stage's tests.

The released vLLM refuses a CPU in places that have nothing to do with what is tested here;
each is patched INSIDE THE TESTS ONLY, here, and named:

- ``ParallelConfig`` / ``VllmConfig`` validation refuses ``enable_eplb`` unless the platform is
  CUDA, ROCm or XPU: ``current_platform.is_cuda_alike`` answers True while the configs are
  built (``cpu_configs``), nowhere else.
- ``torch.accelerator.current_stream()`` (the gloo communicator's wait for its staging copies)
  has no accelerator on a CPU: ``cpu_streams`` gives a stream whose ``synchronize`` returns.
- ``torch.Event(enable_timing=True)`` (``EplbState.rearrange``'s timing on rank 0) cannot
  record on a CPU: ``cpu_streams`` gives an event whose ``elapsed_time`` is 0.
- Load recording is a Triton kernel only (``eplb_map_to_physical_and_record`` returns the ids
  unrecorded without Triton): ``FakeMoELayer.route`` does what the kernel does with the
  layer's real ``EplbLayerState``: adds this pass's tokens per slot to ``expert_load_view``
  when ``should_record_tensor`` is set.

Everything else is vLLM's own code: ``EplbState``, ``EplbModelState``, ``add_model``,
``step``, ``rearrange``, the gloo communicator, ``rearrange_expert_weights_inplace``.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from unittest import mock

import torch
import torch.multiprocessing as mp

from eplb_tools.ports import free_port

GUIDE_EPLB = {"num_redundant_experts": 32, "window_size": 1000, "step_interval": 2147483647}


def cpu_configs(world: int, **eplb: object) -> tuple[object, object]:
    """``(ParallelConfig, VllmConfig)`` with EPLB on, TP = ``world`` (vLLM's EP group spans
    TP x DP), built with the CUDA-only check answered yes (patched here only)."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.parallel import EPLBConfig
    from vllm.platforms import current_platform

    with mock.patch.object(type(current_platform), "is_cuda_alike", lambda self: True):
        parallel = ParallelConfig(
            tensor_parallel_size=world,
            enable_expert_parallel=True,
            enable_eplb=True,
            eplb_config=EPLBConfig(**eplb),
        )
        return parallel, VllmConfig(parallel_config=parallel)


class _CpuStream:
    def synchronize(self) -> None:
        return None


class _CpuEvent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, *args: object) -> None:
        return None

    def elapsed_time(self, other: object) -> float:
        return 0.0


@contextlib.contextmanager
def cpu_streams() -> Iterator[None]:
    """The accelerator stream and timing events vLLM's rearrangement asks for, on a CPU
    (patched here only)."""
    with (
        mock.patch.object(torch.accelerator, "current_stream", lambda *a: _CpuStream()),
        mock.patch.object(torch, "Event", _CpuEvent),
    ):
        yield


@contextlib.contextmanager
def vllm_world(rank: int, world: int, port: int, **eplb: object) -> Iterator[object]:
    """vLLM's distributed state on gloo (world, EP and EPLB groups), its config current;
    yields the ``ParallelConfig``."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    parallel, config = cpu_configs(world, **eplb)
    with set_current_vllm_config(config):
        ps.init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
            timeout=timedelta(seconds=60),
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=world, backend="gloo")
        try:
            yield parallel
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


class FakeMoELayer:
    """One MoE layer as vLLM's ``EplbState`` sees it: its expert tensors ``[local slots, ...]``
    and a real ``EplbLayerState``."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        from vllm.distributed.eplb.eplb_state import EplbLayerState

        self.weights = weights
        self.eplb_state = EplbLayerState()

    def get_expert_weights(self) -> list[torch.Tensor]:
        return self.weights

    def set_eplb_state(self, moe_layer_idx: int, expert_load_view, logical_to_physical_map, logical_replica_count):
        self.eplb_state.set_layer_state(moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count)

    def route(self, slot_tokens: torch.Tensor) -> None:
        """What vLLM's Triton routing kernel records (Triton-only in the release, so done
        here): this pass's ``[P]`` tokens per slot, when recording is on."""
        if bool(self.eplb_state.should_record_tensor):
            self.eplb_state.expert_load_view.add_(slot_tokens.to(self.eplb_state.expert_load_view.dtype))


def fake_moe(num_layers: int, num_experts: int, num_redundant: int, world: int, rank: int, widths=(4, 2)):
    """A ``MixtureOfExperts`` model (vLLM's protocol, its own ``set_eplb_state``) whose expert
    tensors on this rank hold ``layer * 1000 + expert`` in every element of each slot, laid
    out as vLLM's initial map (experts, then redundant ``i % E``)."""
    from vllm.model_executor.models.interfaces import MixtureOfExperts

    physical = num_experts + num_redundant
    local = physical // world
    initial = [*range(num_experts), *(i % num_experts for i in range(num_redundant))]
    mine = initial[rank * local : (rank + 1) * local]

    class Model(MixtureOfExperts):
        pass

    model = Model()
    model.moe_layers = [
        FakeMoELayer([coded(layer, torch.tensor(mine), w) for w in widths]) for layer in range(num_layers)
    ]
    model.expert_weights = [layer.weights for layer in model.moe_layers]
    model.num_moe_layers = num_layers
    model.num_expert_groups = 1
    model.num_logical_experts = num_experts
    model.num_routed_experts = num_experts
    model.num_physical_experts = physical
    model.num_local_physical_experts = local
    model.num_shared_experts = 0
    model.num_redundant_experts = num_redundant
    return model


def coded(layer: int, experts: torch.Tensor, width: int) -> torch.Tensor:
    """``[slots, width]`` float32 whose values name (layer, expert)."""
    return (layer * 1000 + experts.to(torch.float32))[:, None].repeat(1, width).contiguous()


def model_config(name: str = "fake-moe") -> object:
    """What ``EplbState.add_model`` reads of a ``ModelConfig``: ``model``, and what its key is
    made of: ``compute_hash()`` up to 0.33.0, ``compile_factors()`` (hashed by
    ``hash_config_cached``) from 0.34.0."""

    class _ModelConfig:
        model = name

        def compute_hash(self) -> str:
            return name

        def compile_factors(self) -> dict[str, object]:
            return {"model": name}

    return _ModelConfig()


def state_key(config: object) -> str:
    """The key of ``config``'s model in ``EplbState.model_states``, as this vLLM computes it
    (``hash_config_cached`` where ``vllm.config.utils`` has it, 0.34.0 on; else ``compute_hash()``)."""
    import vllm.config.utils as utils

    return utils.hash_config_cached(config) if hasattr(utils, "hash_config_cached") else config.compute_hash()


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        out[rank] = fn(rank, world, port, *args)
    except BaseException:
        out[rank] = {"error": traceback.format_exc()}
        raise


def run_ranks(fn: Callable, world: int, *args: object) -> dict[int, object]:
    """``fn(rank, world, port, *args)`` on ``world`` spawned processes; their return values."""
    with mp.Manager() as manager:
        out = manager.dict()
        try:
            mp.spawn(_entry, args=(world, free_port(), fn, args, out), nprocs=world, join=True)
        except Exception as exc:
            errors = [v["error"] for v in dict(out).values() if isinstance(v, dict) and "error" in v]
            raise AssertionError("\n".join(errors) or str(exc)) from None
        return dict(out)

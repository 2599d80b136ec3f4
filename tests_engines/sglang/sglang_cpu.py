"""SGLang 0.5.23's real EPLB classes on a CPU, for the engine stage's tests.

What the released code refuses on a CPU, or needs that has nothing to do with what is tested,
is patched HERE, INSIDE THE TESTS ONLY, and named:

- torchvision: ``sglang.srt.configs`` imports ``torchvision.transforms`` (InternVL's image
  utils) on the way to the EPLB modules. PyPI's torchvision is a CUDA build whose ``_C`` does
  not load beside CPU torch, and its import then dies registering fake kernels for
  ``torchvision::nms`` & co (``operator torchvision::nms does not exist``).
  ``patch_torchvision`` (run on import of this module, before any SGLang import) makes
  ``torch.library.register_fake`` skip ``torchvision::`` operators only; nothing tested here
  calls one. The smallest change that lets the released modules import unedited.
- The model config: ``ExpertLocationMetadata.init_by_mapping`` reads the layer and expert
  counts through ``ModelConfigForExpertLocation.from_model_config``, which needs a model
  architecture; ``sglang_args`` answers it with the counts given (``mock.patch``).
- GPU host copies: on a CPU server ``physical_to_logical_map.cpu()`` is the tensor itself, so
  the ``_cpu`` fields alias the live ones; ``gpu_like`` makes them separate copies, as a GPU
  server has them.

Everything else is SGLang's own: ``ExpertLocationMetadata`` (``init_by_mapping``, ``update``,
``logical_to_all_physical``), ``compute_logical_to_rank_dispatch_physical_map``, the a2a cut in
``_compute_logical_to_all_physical_map``, ``ExpertLocationUpdater`` over gloo, ``EPLBManager``'s
plugin hook (``HookRegistry``), the server-args context (``override_server_args``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch


def patch_torchvision() -> None:
    """``torch.library.register_fake`` skips ``torchvision::`` operators (see the module doc)."""
    if getattr(torch.library.register_fake, "_skips_torchvision", False):
        return
    original = torch.library.register_fake

    def register_fake(op: object, *args: object, **kwargs: object) -> object:
        name = op if isinstance(op, str) else getattr(op, "_name", "")
        if isinstance(name, str) and name.startswith("torchvision::"):
            return lambda fn: fn
        return original(op, *args, **kwargs)

    register_fake._skips_torchvision = True
    torch.library.register_fake = register_fake


patch_torchvision()


@contextlib.contextmanager
def sglang_args(topology: object, **fields: object) -> Iterator[object]:
    """SGLang's server args published for this process (``get_context().override_server_args``:
    CPU device, TP = EP = the topology's gpus, ``num_slots - num_experts`` redundant experts,
    ``fields`` on top), restored on exit; the model's layer and expert counts answered for
    ``init_by_mapping`` (patched, see above)."""
    from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
    from sglang.srt.runtime_context import get_context

    t = topology
    override = get_context().override_server_args(
        device="cpu",
        tp_size=t.num_gpus,
        ep_size=t.num_gpus,
        ep_num_redundant_experts=t.num_slots - t.num_experts,
        **fields,
    )
    answer = ModelConfigForExpertLocation(num_layers=t.num_layers, num_logical_experts=t.num_experts)
    with (
        override as server_args,
        mock.patch.object(ModelConfigForExpertLocation, "from_model_config", staticmethod(lambda model_config: answer)),
    ):
        yield server_args


def metadata(physical_to_logical_map: torch.Tensor, ep_rank: int) -> object:
    """SGLang's own ``ExpertLocationMetadata.init_by_mapping`` for this rank, under the args
    ``sglang_args`` published; host copies made separate (``gpu_like``)."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    built = ExpertLocationMetadata.init_by_mapping(None, physical_to_logical_map.clone(), moe_ep_rank=ep_rank)
    return gpu_like(built)


def gpu_like(md: object) -> object:
    """The metadata with its ``_cpu`` fields as tensors of their own, as on a GPU server."""
    return dataclasses.replace(
        md,
        physical_to_logical_map_cpu=md.physical_to_logical_map.clone(),
        logical_to_all_physical_map_cpu=md.logical_to_all_physical_map.clone(),
    )

"""vLLM drop-in: a ``vllm.general_plugins`` entry point (``eplb = eplb_engine.adapters.vllm_plugin:register``)
that makes vLLM's own EPLB follow the eplb service, without editing vLLM's files.

vLLM calls ``register()`` in every process it starts, before the model is built. With
``EPLB_ADDRESSES`` unset it does nothing (installing eplb changes no vLLM). With it set, it wraps
two methods of vLLM's ``EplbState`` class at import time:

- ``add_model``: after vLLM built a model's ``EplbModelState``, ``take_over`` hands the state
  to eplb (records every step, no rearrangement of vLLM's own, no ``log_balancedness``
  all-reduce) and ``wire_rank`` builds this rank's ``eplb_engine.BalancedRank`` for it (on
  vLLM's EP group), which connects it to the service;
- ``step`` (called by the model runner after each forward pass, dummy ones included, on every
  EP rank): after vLLM's own step the pass's loads (``last_step_loads``) are reported under the
  version they were routed with, then the rank's rollout runs its step boundary: a new
  placement's weights are moved in the background and switched, with the maps, between this
  pass and the next, on every rank at the same step.

Settings, from the environment: ``EPLB_ADDRESSES`` (the service, comma-separated),
``EPLB_DEPLOYMENT`` (default: the model's name; a second model, a draft, gets ``-draft-N``
appended in the order vLLM adds it, and a ``BalancedRank`` of its own: its switches are agreed
apart from the target's). Start vLLM with ``--enable-eplb`` and the redundant
slots wanted (``--eplb-config '{"num_redundant_experts": 32}'``); ``step_interval`` no longer
matters. Supported vLLM: ``eplb_engine.adapters.vllm.SUPPORTED_VLLM``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["ENV_ADDRESSES", "ENV_DEPLOYMENT", "install", "register", "wire_rank"]

ENV_ADDRESSES = "EPLB_ADDRESSES"
ENV_DEPLOYMENT = "EPLB_DEPLOYMENT"

Wire = Callable[[Any, Any, str], Any]


def register() -> None:
    """vLLM's plugin hook: installs the wrappers on ``EplbState`` when ``EPLB_ADDRESSES`` is set."""
    addresses = os.environ.get(ENV_ADDRESSES, "").strip()
    if not addresses:
        return
    from vllm.distributed.eplb.eplb_state import EplbState

    from .vllm import check_vllm_version

    check_vllm_version()
    install(EplbState, lambda state, model_state, name: wire_rank(addresses, name, state, model_state))


def install(eplb_state_class: type, wire: Wire) -> None:
    """Wrap ``eplb_state_class.add_model`` and ``.step`` (idempotent: vLLM may load plugins
    more than once). ``wire(eplb_state, model_state, deployment)`` returns this rank's object
    with ``step(step)``, ``record(counts [L, P])`` and ``close()`` (``wire_rank``: a
    ``BalancedRank``)."""
    if eplb_state_class.__dict__.get("_eplb_installed"):
        return
    add_model, step = eplb_state_class.add_model, eplb_state_class.step

    def eplb_add_model(self: Any, model: Any, model_config: Any, model_name: str | None = None) -> None:
        from .vllm import take_over

        add_model(self, model, model_config, model_name)
        take_over(self)
        ranks = self.__dict__.setdefault("_eplb_ranks", {})
        key = model_config.compute_hash()
        name = os.environ.get(ENV_DEPLOYMENT) or str(model_name or model_config.model)
        if ranks:
            name = f"{name}-draft-{len(ranks)}"
        ranks[key] = wire(self, self.model_states[key], name)
        self._eplb_step = 0

    def eplb_step(self: Any, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        from .vllm import last_step_loads

        step(self, is_dummy, is_profile, log_stats)
        ranks = self.__dict__.get("_eplb_ranks")
        if not ranks or is_profile:  # the profile run returns before vLLM counts a step
            return
        self._eplb_step += 1
        for key, rank in ranks.items():
            if not is_dummy:
                rank.record(last_step_loads(self, self.model_states[key]))
            rank.step(self._eplb_step)  # the boundary before the next pass

    eplb_add_model.__wrapped__ = add_model
    eplb_step.__wrapped__ = step
    eplb_state_class.add_model = eplb_add_model
    eplb_state_class.step = eplb_step
    eplb_state_class._eplb_installed = True


def wire_rank(addresses: str, deployment: str, eplb_state: Any, model_state: Any) -> Any:
    """This EP rank's ``eplb_engine.BalancedRank`` for ``model_state``, following deployment
    ``deployment`` at ``addresses``: rank 0 creates it from vLLM's current map (``exist_ok``),
    then every rank builds its ``BalancedRank`` on vLLM's EP group (the barrier's all-reduce on
    its gloo ``cpu_group``, the mover's transfers on a group of their own: NCCL for CUDA
    weights, gloo otherwise), which acks the version it holds and reports, watches and rolls
    out; a switch writes the rows that switch into vLLM's maps (``apply_to_vllm``). A
    deployment whose current placement is not the map vLLM serves is refused (the weights and
    the loads would follow the service's map while vLLM routes with its own). Collective over
    the world (vLLM adds models on every rank in one order)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_ep_group

    import eplb

    from ..balanced_rank import BalancedRank
    from ..client import ServiceClient
    from .vllm import apply_to_vllm, from_vllm

    ep = get_ep_group()
    model = model_state.model
    rank = ep.rank_in_group
    topo = eplb.Topology(
        num_layers=model.num_moe_layers,
        num_experts=model.num_logical_experts,
        num_slots=model.num_physical_experts,
        num_gpus=ep.world_size,
    )
    serving = from_vllm(model_state.physical_to_logical_map, topo)
    if rank == 0:
        with ServiceClient(addresses) as client:
            client.create_deployment(deployment, topo, initial=serving, exist_ok=True)
    dist.barrier(group=ep.cpu_group)  # the deployment exists before any rank reads it
    layers = [{f"t{i}": t for i, t in enumerate(per_layer)} for per_layer in model.expert_weights]
    backend = "nccl" if model_state.physical_to_logical_map.is_cuda else "gloo"
    balanced = BalancedRank(
        addresses,
        deployment,
        rank,
        topo,
        layers,
        ep.cpu_group,
        mover_group=dist.new_group(ranks=list(ep.ranks), backend=backend),
        on_switch=lambda step, chunk, routing: apply_to_vllm(model_state, routing, layers=chunk),
    )
    if balanced.rollout.current.placement != serving:
        version = balanced.rollout.current.version
        balanced.close()
        raise RuntimeError(
            f"deployment {deployment!r} is at version {version}, whose placement is not the map vLLM serves "
            "(vLLM starts from its own default map): use a new deployment name (EPLB_DEPLOYMENT) or delete the "
            "deployment at the service"
        )
    return balanced

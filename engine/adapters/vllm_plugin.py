"""vLLM drop-in: a ``vllm.general_plugins`` entry point (``eplb = eplb_engine.adapters.vllm_plugin:register``)
that makes vLLM's own EPLB follow the eplb service, without editing vLLM's files.

vLLM calls ``register()`` in every process it starts, before the model is built. With
``EPLB_ADDRESSES`` unset it does nothing (installing eplb changes no vLLM). With it set, it wraps
two methods of vLLM's ``EplbState`` class at import time:

- ``add_model``: after vLLM built a model's ``EplbModelState``, ``take_over`` hands the state
  to eplb (records every step, no rearrangement of vLLM's own, no ``log_balancedness``
  all-reduce); the model waits to be wired until the next ``step``, since vLLM adds a draft
  model and its target one after the other (the draft first: ``GPUModelRunner.load_model``;
  from 0.34.0 ``EPLBController.maybe_register_speculator``, then ``maybe_register_model``);
- ``step`` (called by the model runner after each forward pass, dummy and profile ones
  included, on every EP rank): the first call after models were added wires them
  (``wire_rank``: this rank's ``eplb_engine.BalancedRank`` on vLLM's EP group, connected to
  the service; a draft joins its target's as ``draft=``, so that their switches are agreed
  in one all-reduce and, when both change, made at the same step). Then, after vLLM's own
  step, the pass's loads (``last_step_loads``) are reported under the version they were
  routed with, per model, and the rank's rollouts run their step boundary: a new placement's
  weights are moved in the background and switched, with the maps, between this pass and the
  next, on every rank at the same step.

Settings, from the environment: ``EPLB_ADDRESSES`` (the service, comma-separated),
``EPLB_READ_ADDRESSES`` (reads-only instances the placements are read from first; optional),
``EPLB_DEPLOYMENT`` (default: the target model's name; its draft, the model vLLM adds with a
``model_name`` ending in ``" (draft)"`` (``eplb_draft_model_name``), gets ``-draft-1``
appended). Start vLLM with ``--enable-eplb`` and the redundant
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
# The host's node agent (eplb agent): its Unix socket; unset, each rank reports on its own.
ENV_NODE_AGENT = "EPLB_NODE_AGENT"
ENV_READ_ADDRESSES = "EPLB_READ_ADDRESSES"
DRAFT_SUFFIX = " (draft)"  # vLLM's eplb_draft_model_name: f"{model_config.model} (draft)"

Wire = Callable[[Any, Any, str, "tuple[Any, str] | None"], Any]


def register() -> None:
    """vLLM's plugin hook: installs the wrappers on ``EplbState`` when ``EPLB_ADDRESSES`` is set."""
    addresses = os.environ.get(ENV_ADDRESSES, "").strip()
    if not addresses:
        return
    from vllm.distributed.eplb.eplb_state import EplbState

    from .vllm import check_vllm_version

    check_vllm_version()
    install(
        EplbState,
        lambda state, model_state, name, draft: wire_rank(addresses, name, state, model_state, draft=draft),
    )


def install(eplb_state_class: type, wire: Wire) -> None:
    """Wrap ``eplb_state_class.add_model`` and ``.step`` (idempotent: vLLM may load plugins
    more than once). ``wire(eplb_state, model_state, deployment, draft)`` returns this rank's
    object with ``step(step)``, ``record(counts [L, P])`` and ``close()``, and, with ``draft``
    given as ``(draft_model_state, draft_deployment)``, ``draft.record(counts)``
    (``wire_rank``: a ``BalancedRank``)."""
    if eplb_state_class.__dict__.get("_eplb_installed"):
        return
    add_model, step = eplb_state_class.add_model, eplb_state_class.step

    def eplb_add_model(self: Any, model: Any, model_config: Any, model_name: str | None = None) -> None:
        from .vllm import take_over

        before = list(self.model_states.values())
        add_model(self, model, model_config, model_name)
        take_over(self)
        if self.__dict__.get("_eplb_ranks"):
            raise RuntimeError(
                "a model added after the drop-in wired its models at the first step() is not supported: vLLM "
                "adds the target and its draft before it steps"
            )
        # The key of the state add_model built, found rather than computed: vLLM keys
        # model_states by model_config.compute_hash() up to 0.33.0 and by
        # vllm.config.utils.hash_config_cached(model_config) from 0.34.0.
        (key,) = [k for k, v in self.model_states.items() if not any(v is old for old in before)]
        self.__dict__.setdefault("_eplb_pending", []).append((key, model_name, model_config))
        self._eplb_step = 0

    def wire_pending(self: Any) -> None:
        # Wired at the first step, not at add_model: vLLM adds the draft before its target,
        # and the draft can only join the target's BalancedRank when that one is built.
        pending = self.__dict__.pop("_eplb_pending")
        drafts = [p for p in pending if (p[1] or "").endswith(DRAFT_SUFFIX)]
        targets = [p for p in pending if p not in drafts]
        if not drafts and len(targets) > 1:  # added by hand, unnamed: the later ones are drafts
            targets, drafts = targets[:1], targets[1:]
        if len(targets) != 1 or len(drafts) > 1:
            raise RuntimeError(
                f"the drop-in wires one target model and at most one draft; vLLM added {len(targets)} target(s) "
                f"and {len(drafts)} draft(s) (drafts: model_name ending in {DRAFT_SUFFIX!r})"
            )
        key, model_name, model_config = targets[0]
        name = os.environ.get(ENV_DEPLOYMENT) or str(model_name or model_config.model)
        draft = (self.model_states[drafts[0][0]], f"{name}-draft-1") if drafts else None
        balanced = wire(self, self.model_states[key], name, draft)
        self._eplb_ranks = {key: balanced}
        self._eplb_records = {key: balanced.record}
        if drafts:
            self._eplb_records[drafts[0][0]] = balanced.draft.record

    def eplb_step(self: Any, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        from .vllm import last_step_loads

        if self.__dict__.get("_eplb_pending"):
            wire_pending(self)  # collective: every EP rank steps, the profile run included
        step(self, is_dummy, is_profile, log_stats)
        ranks = self.__dict__.get("_eplb_ranks")
        if not ranks or is_profile:  # the profile run returns before vLLM counts a step
            return
        self._eplb_step += 1
        if not is_dummy:
            for key, record in self._eplb_records.items():
                record(last_step_loads(self, self.model_states[key]))
        for rank in ranks.values():
            rank.step(self._eplb_step)  # the boundary before the next pass: target and draft together

    eplb_add_model.__wrapped__ = add_model
    eplb_step.__wrapped__ = step
    eplb_state_class.add_model = eplb_add_model
    eplb_state_class.step = eplb_step
    eplb_state_class._eplb_installed = True


def wire_rank(
    addresses: str, deployment: str, eplb_state: Any, model_state: Any, draft: tuple[Any, str] | None = None
) -> Any:
    """This EP rank's ``eplb_engine.BalancedRank`` for ``model_state``, following deployment
    ``deployment`` at ``addresses``: rank 0 creates it from vLLM's current map (``exist_ok``),
    then every rank builds its ``BalancedRank`` on vLLM's EP group (the barrier's all-reduce on
    its gloo ``cpu_group``, the mover's transfers on a group of their own: NCCL for CUDA
    weights, gloo otherwise), which acks the version it holds and reports, watches and rolls
    out; a switch writes the rows that switch into vLLM's maps (``apply_to_vllm``).
    ``draft``: ``(draft_model_state, draft_deployment)``, a draft model created and followed
    the same way as the ``BalancedRank``'s ``draft=`` (own experts, slots, loads and versions;
    its switches agreed with the target's in the same all-reduce, at the same step when both
    change). A deployment whose current placement is not the map vLLM serves is refused (the
    weights and the loads would follow the service's map while vLLM routes with its own).
    Collective over the world (every rank wires its models at the same step)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_ep_group

    import eplb

    from ..balanced_rank import BalancedRank, Draft
    from ..client import ServiceClient
    from .vllm import apply_to_vllm, from_vllm

    ep = get_ep_group()
    rank = ep.rank_in_group
    models = [(deployment, model_state)] + ([(draft[1], draft[0])] if draft is not None else [])
    specs = []  # per model: deployment, its state, topology, the map vLLM serves, this rank's tensors
    for name, state in models:
        model = state.model
        topo = eplb.Topology(
            num_layers=model.num_moe_layers,
            num_experts=model.num_logical_experts,
            num_slots=model.num_physical_experts,
            num_gpus=ep.world_size,
        )
        tensors = [{f"t{i}": t for i, t in enumerate(per_layer)} for per_layer in model.expert_weights]
        specs.append((name, state, topo, from_vllm(state.physical_to_logical_map, topo), tensors))
    if rank == 0:
        with ServiceClient(addresses) as client:
            for name, _, topo, serving, _ in specs:
                client.create_deployment(name, topo, initial=serving, exist_ok=True)
    dist.barrier(group=ep.cpu_group)  # the deployments exist before any rank reads them

    def switcher(state: Any) -> Callable[[int, tuple[int, ...], eplb.Placement], None]:
        return lambda step, chunk, routing: apply_to_vllm(state, routing, layers=chunk)

    backend = "nccl" if model_state.physical_to_logical_map.is_cuda else "gloo"
    (_, _, topo, _, layers), drafted = specs[0], specs[1:]
    balanced = BalancedRank(
        addresses,
        deployment,
        rank,
        topo,
        layers,
        ep.cpu_group,
        mover_group=dist.new_group(ranks=list(ep.ranks), backend=backend),
        on_switch=switcher(model_state),
        node_agent=os.environ.get(ENV_NODE_AGENT) or None,
        reads=os.environ.get(ENV_READ_ADDRESSES, "").strip() or None,
        draft=Draft(drafted[0][0], drafted[0][4], drafted[0][2], on_switch=switcher(drafted[0][1]))
        if drafted
        else None,
    )
    for (name, _, _, serving, _), part in zip(specs, balanced.parts):
        if part.rollout.current.placement != serving:
            version = part.rollout.current.version
            balanced.close()
            raise RuntimeError(
                f"deployment {name!r} is at version {version}, whose placement is not the map vLLM serves "
                "(vLLM starts from its own default map): use a new deployment name (EPLB_DEPLOYMENT) or delete "
                "the deployment at the service"
            )
    return balanced

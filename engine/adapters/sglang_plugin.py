"""SGLang drop-in: a ``sglang.srt.plugins`` entry point (``eplb = eplb_engine.adapters.sglang_plugin:register``)
that puts SGLang's EPLB under the eplb service, without editing SGLang's files.

SGLang (0.5.23) calls every general plugin in each process it starts (``load_plugins``), then
applies the hooks they registered. With ``EPLB_ADDRESSES`` unset ``register()`` does nothing
(installing eplb changes no SGLang). With it set, it registers ``EplbServiceManager`` as a
class ``REPLACE`` of ``sglang.srt.eplb.eplb_manager.EPLBManager`` (``HookRegistry``); SGLang's
model runner builds its EPLB manager from it when started with ``--enable-eplb``, and calls
its ``on_forward_pass_end()`` after each forward pass on every rank. The manager:

- never rebalances by itself (SGLang's ``rebalance`` generator is not run);
- at the first pass (the model is loaded by then) builds this rank's ``eplb_engine.BalancedRank``
  for the model's MoE layers (``moe_layer_rows``): rank 0 creates the deployment from SGLang's
  current map (``exist_ok``), every rank checks that the service's current placement is the map
  it serves; the weights it moves are ``routed_experts_weights_of_layer``'s tensors;
- every ``report_every`` passes (default: ``--eplb-rebalance-num-iterations``, at most the
  recorder's buffer) dumps SGLang's expert-distribution recorder (``dump_record``, which
  all-reduces the counts over the ranks) and reports the ``[L, E]`` counts from rank 0 only;
  before each switch it dumps too, so that no pass is folded with a map it was not routed with;
- at each step boundary runs the rollout; at a switch writes the new maps into SGLang's global
  ``ExpertLocationMetadata`` (``apply_to_sglang``: host copies, the a2a cut and the static
  dispatch table as SGLang derives them; a chunk of a chunked switch takes the target's table
  rows, as SGLang's own chunked update does).

Settings, from the environment: ``EPLB_ADDRESSES`` (the service, comma-separated),
``EPLB_READ_ADDRESSES`` (reads-only instances the placements are read from first; optional),
``EPLB_DEPLOYMENT`` (default: the model path), ``EPLB_REPORT_EVERY`` (passes between reports).
Start SGLang with ``--enable-eplb --ep-num-redundant-experts N`` (the recorder then records in
``stat`` mode). Supported SGLang: ``eplb_engine.adapters.sglang.SUPPORTED_SGLANG``; EP must span
the whole world (as SGLang's own updater assumes); elastic EP and draft models are not covered.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "ENV_ADDRESSES",
    "ENV_DEPLOYMENT",
    "ENV_REPORT_EVERY",
    "TARGET",
    "EplbServiceManager",
    "register",
    "wire_rank",
]

ENV_ADDRESSES = "EPLB_ADDRESSES"
ENV_DEPLOYMENT = "EPLB_DEPLOYMENT"
ENV_REPORT_EVERY = "EPLB_REPORT_EVERY"
# The host's node agent (eplb agent): its Unix socket; unset, each rank reports on its own.
ENV_NODE_AGENT = "EPLB_NODE_AGENT"
ENV_READ_ADDRESSES = "EPLB_READ_ADDRESSES"
TARGET = "sglang.srt.eplb.eplb_manager.EPLBManager"

Wire = Callable[["EplbServiceManager"], Any]


def register() -> None:
    """SGLang's plugin hook: replaces ``EPLBManager`` when ``EPLB_ADDRESSES`` is set."""
    if not os.environ.get(ENV_ADDRESSES, "").strip():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .sglang import check_sglang_version

    check_sglang_version()
    HookRegistry.register(TARGET, EplbServiceManager, HookType.REPLACE)


class EplbServiceManager:
    """Stands in for SGLang's ``EPLBManager`` (same constructor, same methods the model runner
    and elastic EP call); see the module doc. ``wire(manager)`` builds this rank's
    ``BalancedRank`` at the first pass (default ``wire_rank``: the service at
    ``EPLB_ADDRESSES``)."""

    def __init__(
        self,
        *,
        model_config: Any,
        get_model: Callable[[], Any],
        get_expert_location_updater: Callable[[], Any],
        get_expert_backup_client: Callable[[], Any],
        get_weight_updater: Callable[[], Any],
        wire: Wire | None = None,
    ) -> None:
        from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
        from sglang.srt.runtime_context import get_exec, get_parallel

        moe = get_exec().moe
        self.model_config, self.get_model = model_config, get_model
        self._wire = wire or wire_rank
        self.a2a = str(moe.moe_a2a_backend or "none") != "none"
        self.nnodes = int(get_parallel().nnodes)
        every = os.environ.get(ENV_REPORT_EVERY) or moe.eplb_rebalance_num_iterations or 1000
        buffer = moe.expert_distribution_recorder_buffer_size
        self.report_every = max(1, min(int(every), int(buffer)) if buffer and int(buffer) > 0 else int(every))
        self.recorder = get_global_expert_distribution_recorder()
        if not self.recorder.recording:
            self.recorder.start_record()  # the Noop recorder (no recorder mode) raises here, saying so
        self.rank: Any = None
        self.ep_rank = 0
        self.rows: list[int] = []
        self.steps = 0
        self.reported_at = 0  # the step of the last dump: the steps the next report covers
        self.world = 1
        self.disabled_reason: str | None = None

    def on_forward_pass_end(self) -> None:
        """After each forward pass, every rank: wire (first pass), report, step the rollout."""
        if self.rank is None:
            self.rank = self._wire(self)
        self.steps += 1
        if self.steps % self.report_every == 0:
            self.report()
        self.rank.step(self.steps)

    def report(self) -> None:
        """Collective (the recorder all-reduces): dump the recorder; rank 0 reports the counts."""
        from .sglang import sglang_expert_loads

        dump = self.recorder.dump_record(output_mode="object")
        # The dump is all ranks' counts since the last one: rank-steps are those steps times the
        # ranks, so the service reads tokens per gpu per step from it (ReportLoadRequest.steps).
        steps, self.reported_at = self.steps - self.reported_at, self.steps
        if self.ep_rank == 0:
            self.rank.reporter.add(sglang_expert_loads(dump["logical_count"], self.rows), steps=steps * self.world)

    def on_switch(self, step: int, layers: tuple[int, ...], routing: Any) -> None:
        """The rollout's switch (every rank, same step): report what the old map routed, then
        write the new rows into SGLang's global metadata."""
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        from .sglang import apply_to_sglang

        self.report()
        live = get_global_expert_location_metadata()
        dispatch = live.logical_to_rank_dispatch_physical_map is not None
        apply_to_sglang(
            live,
            routing,
            layer_ids=self.rows,
            ep_rank=self.ep_rank if dispatch or self.a2a else None,
            layers=layers,
            a2a=self.a2a,
            nnodes=self.nnodes,
            target=_switch_target(getattr(self.rank, "rollout", None)),
        )

    # What SGLang's model runner and elastic EP call on an EPLBManager.
    def reset_generator(self) -> None:
        return None

    def disable_rebalance(self, reason: str) -> None:
        # Steps keep running on every rank (the rollout's barrier is collective); the reason is
        # kept for whoever asks. Elastic EP scale-up is not covered by eplb's drop-in.
        self.disabled_reason = reason

    def enable_rebalance(self) -> None:
        self.disabled_reason = None

    def rebalance(self) -> Iterator[None]:
        """SGLang's own rebalance, asked for after a rank fault: eplb's service re-plans, so nothing."""
        return iter(())

    def close(self) -> None:
        if self.rank is not None:
            self.rank.close()


def _switch_target(rollout: Any) -> Any:
    """The placement the rollout's switch in progress heads to (a chunk's static dispatch rows
    are the target's, as in SGLang's chunked update), or None."""
    target = getattr(rollout, "switch_target", None)
    return target.placement if target is not None else None


def wire_rank(manager: EplbServiceManager) -> Any:
    """This rank's ``BalancedRank`` for the model ``manager`` serves, at ``EPLB_ADDRESSES``.
    Collective over the world (every rank at its first pass)."""
    import torch.distributed as dist
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    import eplb

    from ..balanced_rank import BalancedRank
    from ..client import ServiceClient
    from .sglang import from_sglang, moe_layer_rows, moe_layer_weights

    addresses = os.environ[ENV_ADDRESSES]
    live = get_global_expert_location_metadata()
    if live is None:
        raise RuntimeError("SGLang has no expert-location metadata: is the model an MoE with --enable-eplb?")
    world, rank = dist.get_world_size(), dist.get_rank()
    if live.ep_size != world:
        raise RuntimeError(
            f"eplb's SGLang drop-in needs EP over the whole world (as SGLang's updater): ep_size {live.ep_size}, "
            f"world {world}"
        )
    model = manager.get_model()
    manager.rows = moe_layer_rows(model)
    weights = moe_layer_weights(model)
    topo = eplb.Topology(
        num_layers=len(manager.rows),
        num_experts=live.num_logical_experts,
        num_slots=live.num_physical_experts,
        num_gpus=world,
    )
    serving = from_sglang(live.physical_to_logical_map_cpu[manager.rows], topo)
    deployment = os.environ.get(ENV_DEPLOYMENT) or str(getattr(manager.model_config, "model_path", "sglang-model"))
    if rank == 0:
        with ServiceClient(addresses) as client:
            client.create_deployment(deployment, topo, initial=serving, exist_ok=True)
    dist.barrier()  # the deployment exists before any rank reads it
    manager.ep_rank = rank
    manager.world = world
    layers = [{f"t{i}": t for i, t in enumerate(weights[row])} for row in manager.rows]
    balanced = BalancedRank(
        addresses,
        deployment,
        rank,
        topo,
        layers,
        on_switch=manager.on_switch,
        node_agent=os.environ.get(ENV_NODE_AGENT) or None,
        reads=os.environ.get(ENV_READ_ADDRESSES, "").strip() or None,
    )
    if balanced.rollout.current.placement != serving:
        version = balanced.rollout.current.version
        balanced.close()
        raise RuntimeError(
            f"deployment {deployment!r} is at version {version}, whose placement is not the map SGLang serves: "
            "start SGLang with --init-expert-location set to the service's current placement (eplb place "
            "--format sglang), or use a new deployment name (EPLB_DEPLOYMENT)"
        )
    return balanced

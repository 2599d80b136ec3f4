"""Wire messages <-> core objects: windows, triggers, library options and plan stats.

Only conversions: every check of what a client sent lives in :mod:`.validation`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import eplb
from eplb import limits

# The survivor rules (policy "auto" at effort "fast", the base version's loads) and the release
# recorded in each plan: one definition with the engine ranks, which compute the same plan.
from eplb.survivor_rules import EPLB_VERSION, SURVIVOR_OPTIONS, SURVIVOR_POLICY  # noqa: F401  (read as codec.*)
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import arrays
from .rollout import DEFAULT_SWITCH_MARGIN
from .trigger import TriggerSpec
from .windows import WindowSpec

__all__ = [
    "deployment_ranks",
    "down_gpus",
    "gpu_ranks",
    "live_ranks",
    "survivor_loads",
    "accepts",
    "replans",
    "migration_options",
    "plan_stats",
    "planning_options",
    "switch_margin",
    "transfer_stats",
    "trigger_spec",
    "window_spec",
]


# Migration's fields are named as the library's re-plan options (eplb.Migration).
MIGRATION_FIELDS = tuple(f.name for f in dataclasses.fields(eplb.Migration))


def replans(policy: str) -> bool:
    """Whether ``policy`` re-plans migration-aware (the library's registry says; the others
    take no re-plan options and re-plan from scratch)."""
    return policy in eplb.policies() and eplb.get_policy(policy).replans


def accepts(policy: str, option: str) -> bool:
    """Whether the library's ``policy`` takes ``option`` (its registered options)."""
    return policy in eplb.policies() and option in eplb.get_policy(policy).option_names()


def policies_where(test: object) -> list[str]:
    """Registered policies for which ``test(name)`` holds, for error messages."""
    return [p for p in eplb.policies() if test(p)]


def migration_options(msg: pb.Migration, policy: str) -> dict[str, float]:
    """A checked ``Migration`` → ``eplb.rebalance`` keyword options (only those it sets, and none
    for policies that re-plan from scratch)."""
    if not replans(policy):
        return {}
    return {name: getattr(msg, name) for name in MIGRATION_FIELDS if msg.HasField(name)}


def deployment_ranks(msg: pb.Deployment) -> list[int]:
    """The ranks that report and acknowledge (deployments stored before ranks existed: one per gpu)."""
    return list(msg.ranks) if msg.ranks else list(range(msg.topology.num_gpus))


def gpu_ranks(msg: pb.Deployment) -> list[int] | None:
    """``ranks[g]`` for each gpu ``g`` (``Deployment.ranks``'s first ``num_gpus``); None when the
    deployment names fewer ranks than gpus (no rank-to-gpu map: SetRanksDown is refused)."""
    ranks = deployment_ranks(msg)
    G = msg.topology.num_gpus
    return ranks[:G] if len(ranks) >= G else None


def down_gpus(msg: pb.Deployment, placement: pb.Placement) -> list[int]:
    """The gpus of ``placement.down_ranks`` (sorted)."""
    ranks = gpu_ranks(msg) or []
    down = set(placement.down_ranks)
    return [g for g, r in enumerate(ranks) if r in down]


def live_ranks(msg: pb.Deployment, placement: pb.Placement) -> list[int]:
    """The ranks a rollout of ``placement`` counts: the deployment's, less those down in it."""
    down = set(placement.down_ranks)
    return [r for r in deployment_ranks(msg) if r not in down]


def survivor_loads(placement: pb.Placement, shape: tuple[int, int]) -> np.ndarray:
    """float64 ``[L, E]``: ``placement``'s loads snapshot, or ones when it has none."""
    if placement.HasField("loads"):
        return arrays.decode(placement.loads, "loads", shape).astype(np.float64)
    return np.ones(shape)


def switch_margin(msg: pb.Deployment) -> int:
    return msg.switch_margin_steps if msg.HasField("switch_margin_steps") else DEFAULT_SWITCH_MARGIN


def suspect_after_s(msg: pb.Deployment) -> float:
    """``Liveness.suspect_after`` in seconds; 0 when liveness is off."""
    return max(0.0, msg.liveness.suspect_after.ToNanoseconds() / 1e9)


def window_spec(msg: pb.Deployment) -> WindowSpec:
    if msg.window.WhichOneof("kind") == "decay":
        return WindowSpec(kind="decay", half_life_s=msg.window.decay.half_life.ToNanoseconds() / 1e9, duration_s=0.0)
    s = msg.window.sliding
    return WindowSpec(
        kind="sliding",
        duration_s=s.duration.ToNanoseconds() / 1e9,
        report_count=s.report_count,
        buckets=s.buckets or 10,
    )


def trigger_spec(msg: pb.Deployment) -> TriggerSpec:
    """The deployment's trigger, with its one move budget: ``Migration.max_moves`` (unset: none;
    0: no slot may move).
    A ``Trigger.max_moves`` sent on the wire was folded into it on create (validation.py)."""
    t = msg.trigger
    payback = t.max_payback_steps if t.HasField("max_payback_steps") else None
    budget = msg.migration.max_moves if msg.migration.HasField("max_moves") else None
    return TriggerSpec(t.interval.ToNanoseconds() / 1e9, t.report_count, t.min_gain_percent, budget, payback)


# Planning.effort values on the wire: the library's.
EFFORTS = eplb.EFFORTS
# Planning.top_k when unset: DeepSeek-V3's, Qwen3's and Kimi's.
DEFAULT_TOP_K = 8


# A deployment's re-plan without its own Planning.time_limit searches at most this share of its
# trigger interval (and never less than TRIGGER_MIN_SECONDS): the default search is counted in
# work and is deterministic, and this only binds where a plan would fall behind the cadence.
TRIGGER_SHARE = 0.5
TRIGGER_MIN_SECONDS = 1.0


def planning_options(
    msg: pb.Planning,
    policy: str,
    num_layers: int,
    deadline_s: float | None,
    interval_s: float = 0.0,
    batches: list[tuple[int, float]] | None = None,
) -> dict:
    """A checked ``Planning`` → ``eplb.rebalance`` keyword options, those the policy takes (the
    library's registry says). ``deadline_s``: seconds left to the caller (None: none);
    the plan's time limit never runs past it. ``interval_s``: the deployment's trigger interval
    (0: none); without a ``time_limit`` of its own the plan gets ``TRIGGER_SHARE`` of it (at least
    ``TRIGGER_MIN_SECONDS``). ``ilp`` always gets a time limit (at most
    ``limits.ILP_MAX_SECONDS`` for the whole model) and one solver thread. With
    ``kernel_model``, the time options: ``tokens_per_gpu`` the message's, else ``batches`` (the
    sizes the reports showed; none: no time options, the plan is for tokens)."""
    options: dict[str, object] = {}
    limit = msg.time_limit.ToNanoseconds() / 1e9 if msg.HasField("time_limit") else None
    if limit is None and interval_s > 0:
        limit = max(TRIGGER_MIN_SECONDS, TRIGGER_SHARE * interval_s)
    if deadline_s is not None:
        # Leave room to send the answer back before the caller gives up.
        room = max(0.05, 0.8 * deadline_s - 0.05)
        limit = room if limit is None else min(limit, room)
    if msg.kernel_model and (msg.tokens_per_gpu or batches):
        # Planning for time applies to any policy (rebalance plans it after the policy's plan).
        options["kernel_curve"] = msg.kernel_model
        options["tokens_per_gpu"] = list(msg.tokens_per_gpu) or list(batches or ())
        options["top_k"] = msg.top_k if msg.HasField("top_k") else DEFAULT_TOP_K
        options["dispatch"] = msg.dispatch or "even"
    if policy == "ilp":
        total = min(limit or limits.ILP_MAX_SECONDS, limits.ILP_MAX_SECONDS)
        return options | {"time_limit": max(0.01, total / max(1, num_layers)), "workers": 1}
    if not accepts(policy, "time_limit"):
        return options
    if msg.effort and accepts(policy, "effort"):
        options["effort"] = msg.effort
    if msg.HasField("work_budget") and accepts(policy, "work_budget"):
        options["work_budget"] = msg.work_budget
    if limit is not None:
        options["time_limit"] = limit
    return options


def transfer_stats(
    old: eplb.Placement, new: eplb.Placement, topo: eplb.Topology, expert_bytes: int
) -> pb.TransferStats:
    """The weight copies from ``old`` to ``new`` ``[L, P]`` (``eplb.transfer.transfer_schedule``:
    one receive per gpu and expert, in rounds of at most one peer per gpu) → ``TransferStats``,
    timed by the schedule's default bandwidth model. Experts no live gpu held (restores: the
    engines load them, no peer sends them) are counted apart, in ``restored_*``."""
    from eplb.transfer import transfer_schedule

    schedule = transfer_schedule(old, new, topo, expert_bytes=float(expert_bytes))
    restored = schedule.restore_layer
    return pb.TransferStats(
        **schedule.stats(),
        restored_experts=int(restored.size),
        restored_bytes=int(round(float(schedule.expert_bytes[restored].sum()))),
    )


def plan_stats(plan: eplb.Plan, imbalance_before: float) -> pb.PlanStats:
    """``plan`` and the current placement's mean imbalance under the same loads → ``PlanStats``."""
    after = plan.mean_imbalance
    gain = 100.0 * (imbalance_before - after) / imbalance_before if imbalance_before > 0 else 0.0
    return pb.PlanStats(
        policy=plan.policy,
        policy_used=plan.policy_used,
        imbalance_before=imbalance_before,
        imbalance_after=after,
        imbalance_lb=float(plan.imbalance_lb.mean()),
        max_imbalance_after=plan.max_imbalance,
        moves=plan.total_moves,
        solve_seconds=plan.solve_seconds,
        gain_percent=gain,
        notes=list(plan.notes),
        budget_limited=plan.replan is not None and plan.replan.budget_limited,
        predicted_ms=plan.predicted_ms or {},
    )

"""Every check of what a client sent, in one place: names, topologies and the documented limits,
policies, migration and planning options, deployments, ranks. Each failure is an
``InvalidArgument`` naming the field and what is allowed (``ResourceExhausted`` for sizes a
stateless call may not ask for), raised before any state is written.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection

from google.protobuf.message import Message

import eplb
from eplb import limits
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.errors import WireError
from eplb_wire.topology import topology_from_pb, topology_to_pb

from .clip import clip
from .codec import (
    DEFAULT_TOP_K,
    EFFORTS,
    MIGRATION_FIELDS,
    accepts,
    policies_where,
    replans,
)
from .errors import FieldViolation, InvalidArgument, ResourceExhausted
from .rollout import DEFAULT_SWITCH_MARGIN

__all__ = [
    "MAX_NAME",
    "MAX_SEQ",
    "check_deployment",
    "check_ilp_size",
    "check_migration",
    "check_name",
    "check_plan_memory",
    "check_planning",
    "check_policy",
    "check_rank",
    "check_times",
    "topology_from",
]


_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # MAX_NAME


MAX_SEQ = 2**53  # seqs are compared as Lua doubles in Redis: exact below this


DEFAULT_WINDOW_S = 600.0


MAX_NAME = 64  # characters of a deployment name (docs/service.md, "Limits")


def check_name(name: str, field: str) -> str:
    """``name`` if it is a valid deployment name, else INVALID_ARGUMENT on ``field`` quoting it
    clipped (a name of megabytes must not reach a status or a log line whole)."""
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            FieldViolation(field, f"{clip(name)} must be 1-{MAX_NAME} letters, digits, '-', '_' or '.'")
        )
    return name


# protobuf's ranges (google/protobuf/duration.proto, timestamp.proto): a value outside them is
# stored fine but json_format (grpcurl, any JSON tool) then fails on the whole message.
_MAX_DURATION_S = 315_576_000_000
_MIN_TIMESTAMP_S = -62_135_596_800  # 0001-01-01T00:00:00Z
_MAX_TIMESTAMP_S = 253_402_300_799  # 9999-12-31T23:59:59Z
_NANOS = 999_999_999


def check_times(msg: Message, field: str = "") -> list[FieldViolation]:
    """Field violations of every ``Duration`` and ``Timestamp`` set anywhere in ``msg``
    (recursively) outside protobuf's ranges: seconds within +-10,000 years for a duration,
    0001-01-01 to 9999-12-31 for a timestamp, nanos within +-999,999,999 with the sign of seconds
    (0 to 999,999,999 for a timestamp)."""
    out: list[FieldViolation] = []
    for desc, value in msg.ListFields():
        if desc.message_type is None:
            continue
        path = f"{field}.{desc.name}" if field else desc.name
        if desc.is_repeated:  # (no repeated messages hold times today; walked for the future)
            values = value.values() if hasattr(value, "values") else value
            for i, item in enumerate(values):
                if isinstance(item, Message):
                    out += check_times(item, f"{path}[{i}]")
            continue
        kind = desc.message_type.full_name
        if kind == "google.protobuf.Duration":
            s, n = value.seconds, value.nanos
            if not -_MAX_DURATION_S <= s <= _MAX_DURATION_S:
                out.append(FieldViolation(f"{path}.seconds", f"{s} is outside +-{_MAX_DURATION_S} (10,000 years)"))
            if not -_NANOS <= n <= _NANOS:
                out.append(FieldViolation(f"{path}.nanos", f"{n} is outside +-{_NANOS}: carry whole seconds"))
            elif (s > 0 and n < 0) or (s < 0 and n > 0):
                out.append(FieldViolation(f"{path}.nanos", f"{n} must have the sign of seconds ({s}) or be 0"))
        elif kind == "google.protobuf.Timestamp":
            s, n = value.seconds, value.nanos
            if not _MIN_TIMESTAMP_S <= s <= _MAX_TIMESTAMP_S:
                out.append(
                    FieldViolation(f"{path}.seconds", f"{s} is outside 0001-01-01 to 9999-12-31 (seconds since 1970)")
                )
            if not 0 <= n <= _NANOS:
                out.append(FieldViolation(f"{path}.nanos", f"{n} must be 0 to {_NANOS}"))
        else:
            out += check_times(value, path)
    return out


def topology_from(msg: pb.Topology, field: str) -> eplb.Topology:
    """``Topology`` message → ``eplb.Topology`` within the documented limits (eplb_wire's codec);
    0 nodes/groups mean 1."""
    try:
        return topology_from_pb(msg, field, limits=True)
    except WireError as exc:
        raise InvalidArgument([FieldViolation(f, d) for f, d in exc.violations]) from None


def _plannable(msg: pb.Topology, field: str) -> eplb.Topology:
    topo = topology_from(msg, field)
    check_plan_memory(topo, field)
    return topo


def check_plan_memory(topo: eplb.Topology, field: str) -> None:
    """INVALID_ARGUMENT on ``field`` when re-planning ``topo`` needs more memory than a plan may
    take (``eplb.limits.check_plan_bytes``): a topology within the sizes of ``topology_from`` may
    still (few gpus of many slots: the repairs grow with slots per gpu squared). Checked on
    create and on ComputePlacement, so it is refused there, not at its first plan; deployments
    already stored are followed and served whatever it says."""
    try:
        eplb.limits.check_plan_bytes(topo, replan=True)
    except ValueError as exc:
        raise InvalidArgument(FieldViolation(field, str(exc))) from None


def check_policy(policy: str, field: str) -> str:
    policy = policy or "auto"
    if policy not in eplb.policies():
        raise InvalidArgument(
            FieldViolation(field, f"unknown policy {clip(policy)}; registered: {', '.join(eplb.policies())}")
        )
    return policy


def check_migration(msg: pb.Migration, policy: str, field: str, budget_gates: bool = False) -> list[FieldViolation]:
    """Field violations of a ``Migration`` for ``policy`` (empty when it is valid). With
    ``budget_gates`` (a deployment, whose trigger gates publication), ``max_moves`` is allowed
    for every policy: the policies that re-plan from scratch are gated by it."""
    out = []
    for name in MIGRATION_FIELDS:
        if not msg.HasField(name):
            continue
        value = getattr(msg, name)
        if not replans(policy) and not (budget_gates and name == "max_moves"):
            out.append(
                FieldViolation(
                    f"{field}.{name}",
                    f"policy {policy!r} re-plans from scratch; set only for {', '.join(policies_where(replans))}",
                )
            )
        else:
            try:
                eplb.Migration.check_field(name, value, finite=True)
            except ValueError as exc:
                out.append(FieldViolation(f"{field}.{name}", str(exc)))
    return out


def check_deployment(msg: pb.Deployment, field: str = "deployment") -> pb.Deployment:
    """Validates a deployment to create and returns it normalized (defaults filled in)."""
    times = check_times(msg, field)
    if times:
        # The checks below read these times: out of range, they would judge garbage.
        raise InvalidArgument(times)
    out = pb.Deployment()
    out.CopyFrom(msg)
    violations: list[FieldViolation] = []
    for check in (
        lambda: check_name(msg.name, f"{field}.name"),
        lambda: out.topology.CopyFrom(topology_to_pb(_plannable(msg.topology, f"{field}.topology"))),
        lambda: setattr(out, "policy", check_policy(msg.policy, f"{field}.policy")),
    ):
        try:
            check()
        except InvalidArgument as exc:
            violations += exc.violations
    kind = msg.window.WhichOneof("kind")
    if kind is None:
        out.window.sliding.duration.FromSeconds(int(DEFAULT_WINDOW_S))
        out.window.sliding.buckets = 10
    elif kind == "sliding":
        s = msg.window.sliding
        if s.duration.ToNanoseconds() < 0:
            violations.append(FieldViolation(f"{field}.window.sliding.duration", "must be >= 0"))
        if s.duration.ToNanoseconds() == 0 and s.report_count == 0:
            violations.append(FieldViolation(f"{field}.window.sliding", "set duration and/or report_count"))
        if s.buckets > 1000:
            violations.append(FieldViolation(f"{field}.window.sliding.buckets", "must be <= 1000"))
        if s.buckets == 0:
            out.window.sliding.buckets = 10
    elif msg.window.decay.half_life.ToNanoseconds() <= 0:
        violations.append(FieldViolation(f"{field}.window.decay.half_life", "must be > 0"))
    violations += check_migration(msg.migration, out.policy, f"{field}.migration", budget_gates=True)
    violations += check_planning(
        msg.planning, out.policy, f"{field}.planning", msg.topology.num_experts if msg.HasField("topology") else None
    )
    if msg.trigger.HasField("max_payback_steps"):
        if not msg.planning.kernel_model:
            violations.append(
                FieldViolation(
                    f"{field}.trigger.max_payback_steps", "gates on predicted time: set planning.kernel_model"
                )
            )
        elif not 1 <= msg.trigger.max_payback_steps <= 10**9:
            violations.append(FieldViolation(f"{field}.trigger.max_payback_steps", "must be in 1..10^9"))
    if (
        msg.trigger.max_moves
        and msg.migration.HasField("max_moves")
        and msg.trigger.max_moves != msg.migration.max_moves
    ):
        violations.append(
            FieldViolation(
                f"{field}.trigger.max_moves", "deprecated: set migration.max_moves only (the two differ here)"
            )
        )
    if msg.trigger.max_moves and not msg.migration.HasField("max_moves"):
        # One move budget: the deprecated Trigger.max_moves moves to Migration.max_moves (and
        # stays readable where it was).
        out.migration.max_moves = msg.trigger.max_moves
    if replans(out.policy):
        # Stored with the defaults filled in, so a deployment shows the bounds it re-plans with.
        if not out.migration.HasField("tolerance"):
            out.migration.tolerance = eplb.Migration().tolerance
        if not out.migration.HasField("layer_tolerance"):
            out.migration.layer_tolerance = eplb.Migration().layer_tolerance
    violations += _fill_ranks(msg, out, field)
    if not out.HasField("switch_margin_steps"):
        out.switch_margin_steps = DEFAULT_SWITCH_MARGIN
    t = msg.trigger
    interval_ns = t.interval.ToNanoseconds()
    if interval_ns < 0 or 0 < interval_ns < limits.MIN_TRIGGER_INTERVAL_S * 1e9:
        violations.append(
            FieldViolation(
                f"{field}.trigger.interval",
                f"{interval_ns / 1e9:g}s must be 0 (off) or at least {limits.MIN_TRIGGER_INTERVAL_S:g}s",
            )
        )
    after_ns = msg.liveness.suspect_after.ToNanoseconds()
    if after_ns and not (limits.MIN_SUSPECT_AFTER_S * 1e9 <= after_ns <= limits.MAX_SUSPECT_AFTER_S * 1e9):
        violations.append(
            FieldViolation(
                f"{field}.liveness.suspect_after",
                f"{after_ns / 1e9:g}s must be 0 (off) or from {limits.MIN_SUSPECT_AFTER_S:g}s to "
                f"{limits.MAX_SUSPECT_AFTER_S:g}s (7 days)",
            )
        )
    if not (0.0 <= t.min_gain_percent <= 100.0):
        violations.append(
            FieldViolation(f"{field}.trigger.min_gain_percent", f"{t.min_gain_percent} must be in [0, 100]")
        )
    if violations:
        raise InvalidArgument(violations)
    out.ClearField("create_time")
    out.version = 0
    return out


def _fill_ranks(msg: pb.Deployment, out: pb.Deployment, field: str) -> list[FieldViolation]:
    """Checks ``msg.ranks`` (distinct) and fills in 0 .. num_gpus - 1 when it is empty."""
    if not msg.ranks:
        if 0 < msg.topology.num_gpus <= limits.MAX_GPUS:  # else the topology's own violation says why
            del out.ranks[:]
            out.ranks.extend(range(msg.topology.num_gpus))
        return []
    if len(msg.ranks) > limits.MAX_GPUS:
        return [FieldViolation(f"{field}.ranks", f"{len(msg.ranks)} ranks, over the limit of {limits.MAX_GPUS}")]
    dups = sorted(r for r, n in Counter(msg.ranks).items() if n > 1)
    if dups:
        return [FieldViolation(f"{field}.ranks", f"ranks must be distinct; repeated: {dups[:8]}")]
    return []


def check_rank(rank: int, ranks: Collection[int], field: str) -> None:
    if rank not in ranks:
        ranks = sorted(ranks)
        shown = f"{ranks[0]} .. {ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks[:16])
        raise InvalidArgument(FieldViolation(field, f"rank {rank} is not one of the deployment's ranks ({shown})"))


def check_time_planning(msg: pb.Planning, field: str, num_experts: int | None) -> list[FieldViolation]:
    """Field violations of ``Planning``'s time fields (kernel_model, tokens_per_gpu, top_k, dispatch)."""
    from eplb import kernel
    from eplb.timing import DISPATCHES

    out = []
    if not msg.kernel_model:
        given = {
            "tokens_per_gpu": bool(msg.tokens_per_gpu),
            "top_k": msg.HasField("top_k"),
            "dispatch": bool(msg.dispatch),
        }
        return [
            FieldViolation(f"{field}.{name}", "plans for time: set kernel_model too")
            for name, on in given.items()
            if on
        ]
    shipped = kernel.shipped()
    if msg.kernel_model not in shipped:
        out.append(
            FieldViolation(
                f"{field}.kernel_model",
                f"{clip(msg.kernel_model)} is not a shipped kernel model; one of {', '.join(shipped)}",
            )
        )
    if len(msg.tokens_per_gpu) > limits.MAX_BATCH_SIZES:
        out.append(
            FieldViolation(
                f"{field}.tokens_per_gpu", f"{len(msg.tokens_per_gpu)} sizes; at most {limits.MAX_BATCH_SIZES}"
            )
        )
    bad = [b for b in msg.tokens_per_gpu if not 1 <= b <= limits.MAX_TOKENS_PER_GPU]
    if bad:
        out.append(FieldViolation(f"{field}.tokens_per_gpu", f"{bad[0]} is not in 1..{limits.MAX_TOKENS_PER_GPU}"))
    most = min(limits.MAX_TOP_K, num_experts or limits.MAX_TOP_K)
    if msg.HasField("top_k"):
        if not 1 <= msg.top_k <= most:
            out.append(FieldViolation(f"{field}.top_k", f"{msg.top_k} is not in 1..{most} (and at most num_experts)"))
    elif DEFAULT_TOP_K > most:
        out.append(
            FieldViolation(f"{field}.top_k", f"unset means {DEFAULT_TOP_K}, more than the {most} experts: set it")
        )
    if msg.dispatch and msg.dispatch not in DISPATCHES:
        out.append(FieldViolation(f"{field}.dispatch", f"{clip(msg.dispatch)} is not one of {', '.join(DISPATCHES)}"))
    return out


def check_planning(msg: pb.Planning, policy: str, field: str, num_experts: int | None = None) -> list[FieldViolation]:
    """Field violations of a ``Planning`` for ``policy`` (empty when it is valid); the time
    fields apply to every policy."""
    out = check_time_planning(msg, field, num_experts)
    time_fields = ("kernel_model", "tokens_per_gpu", "top_k", "dispatch")
    set_fields = [f.name for f, _ in msg.ListFields() if f.name not in time_fields]

    def planning(p: str) -> bool:
        return accepts(p, "time_limit")

    if set_fields and not planning(policy):
        return [
            FieldViolation(
                f"{field}.{set_fields[0]}",
                f"policy {policy!r} takes no planning options; set them only for {', '.join(policies_where(planning))}",
            )
        ]
    if msg.effort:
        if msg.effort not in EFFORTS:
            out.append(FieldViolation(f"{field}.effort", f"{clip(msg.effort)} is not one of {', '.join(EFFORTS)}"))
        elif not accepts(policy, "effort"):
            out.append(FieldViolation(f"{field}.effort", f"policy {policy!r} has no effort levels; set time_limit"))
    if msg.HasField("work_budget") and not accepts(policy, "work_budget"):
        out.append(FieldViolation(f"{field}.work_budget", f"policy {policy!r} has no work budget; set time_limit"))
    if msg.HasField("time_limit") and msg.time_limit.ToNanoseconds() <= 0:
        out.append(FieldViolation(f"{field}.time_limit", "must be > 0"))
    return out


def check_ilp_size(topo: eplb.Topology, field: str) -> None:
    """RESOURCE_EXHAUSTED when an ``ilp`` plan of ``topo`` is over the documented size."""
    cells = topo.num_experts * topo.num_gpus
    if cells > limits.ILP_MAX_CELLS:
        raise ResourceExhausted(
            f"{field}: policy 'ilp' plans layers of at most {limits.ILP_MAX_CELLS} experts x gpus; this one has "
            f"{topo.num_experts} x {topo.num_gpus} = {cells}. Use policy 'auto'"
        )

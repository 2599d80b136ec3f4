"""The wire contract (``eplb.v1``) ↔ numpy and ``eplb``: arrays, placements, topologies,
deployments, and the gRPC health check.

Everything here goes through ``eplb_wire`` (the generated messages and the one ``Array`` and
``Topology`` codecs: ``topology_to_pb``/``topology_from_pb`` are ``eplb_wire.topology``'s),
never the service, so an engine needs ``eplb_wire`` and ``eplb`` and nothing of ``eplb_service``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

import eplb
from eplb import checks
from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.topology import topology_from_pb, topology_to_pb

__all__ = [
    "PublishedPlacement",
    "encode_array",
    "decode_array",
    "topology_to_pb",
    "topology_from_pb",
    "placement_from_pb",
    "deployment_pb",
    "check_health",
    "SERVICE_NAME",
]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertLoadBalancerService"].full_name


def encode_array(arr: np.ndarray) -> pb.Array:
    """Any-shape array → ``Array``: :func:`eplb_wire.arrays.encode` with ``widen`` (other
    integer dtypes go as int64, other floats as float32; booleans are refused)."""
    return arrays.encode(arr, widen=True)


def decode_array(msg: pb.Array, field: str = "array") -> np.ndarray:
    """``Array`` → a read-only numpy array of its shape; :class:`eplb_wire.arrays.ArrayError`
    (a ``ValueError``) naming ``field`` if the dtype is unknown or the bytes do not fill the shape."""
    return arrays.decode(msg, field)


@dataclass(frozen=True)
class PublishedPlacement:
    """One published version of a deployment's placement, decoded.

    ``placement.phy2log`` is int32 ``[L, P]`` (-1: the slots of a down gpu); ``stats`` is the
    wire ``PlanStats`` (imbalance before and after, moves, transfer figures when the deployment
    knows its expert size). ``down_ranks``: the ranks down in this version (they take no part
    in its rollout); ``down_ranks_version``: the version whose SetRanksDown made that set;
    ``survivor_of``: for a survivor placement, the version it was planned from (0: a normal
    plan); ``loads``: float64 ``[L, E]``, the loads it was planned from (None: not sent);
    ``eplb_version``: the eplb release the service planned it with ("" for version 1).
    """

    deployment: str
    version: int
    placement: eplb.Placement
    stats: pb.PlanStats
    down_ranks: tuple[int, ...] = ()
    down_ranks_version: int = 0
    survivor_of: int = 0
    loads: np.ndarray | None = None
    eplb_version: str = ""


def placement_from_pb(msg: pb.Placement, topology: eplb.Topology) -> PublishedPlacement:
    """``Placement`` message (phy2log int32 ``[L, P]``) → ``PublishedPlacement``; ``ValueError`` if
    it does not fit ``topology``."""
    phy2log = decode_array(msg.phy2log, "placement.phy2log")
    want = (topology.num_layers, topology.num_slots)
    if phy2log.shape != want:
        raise ValueError(
            f"placement.phy2log: shape {list(phy2log.shape)} does not fit the topology's [layers, slots] = {list(want)}"
        )
    if phy2log.dtype.kind != "i":
        raise ValueError(f"placement.phy2log: dtype {phy2log.dtype} must be an integer type")
    loads = None
    if msg.HasField("loads"):
        loads = decode_array(msg.loads, "placement.loads").astype(np.float64)
        if loads.shape != (topology.num_layers, topology.num_experts):
            raise ValueError(
                f"placement.loads: shape {list(loads.shape)} does not fit the topology's [layers, experts] = "
                f"{[topology.num_layers, topology.num_experts]}"
            )
    return PublishedPlacement(
        msg.deployment,
        msg.version,
        eplb.Placement(phy2log, topology),
        msg.stats,
        down_ranks=tuple(int(r) for r in msg.down_ranks),
        down_ranks_version=msg.down_ranks_version,
        survivor_of=msg.survivor_of,
        loads=loads,
        eplb_version=msg.eplb_version,
    )


def deployment_pb(
    name: str,
    topology: eplb.Topology,
    *,
    policy: str = "auto",
    window_s: float | None = None,
    half_life_s: float | None = None,
    interval_s: float = 0.0,
    report_count: int = 0,
    min_gain_percent: float = 0.0,
    max_moves: int | None = None,
    max_layer_moves: int | None = None,
    tolerance: float | None = None,
    layer_tolerance: float | None = None,
    effort: str | None = None,
    work_budget: int | None = None,
    time_limit_s: float | None = None,
    ranks: Sequence[int] = (),
    switch_margin_steps: int | None = None,
    expert_bytes: int = 0,
    kernel_model: str | None = None,
    tokens_per_gpu: Sequence[int] = (),
    top_k: int | None = None,
    dispatch: str | None = None,
    max_payback_steps: int | None = None,
) -> pb.Deployment:
    """A ``Deployment`` message for ``topology``: a sliding window of ``window_s`` seconds (or
    exponential decay with ``half_life_s``; neither: the service's default, sliding 10 minutes;
    both: ``ValueError``), re-planned every ``interval_s`` seconds and/or every
    ``report_count`` reports, published when the gain is at least ``min_gain_percent``.

    ``Migration``: ``tolerance`` and ``layer_tolerance`` (finite fractions >= 0; None: the
    service fills in the library's 0.01 and 0.05), ``max_moves`` and ``max_layer_moves``
    (integers >= 0, slots rewritten per re-plan in all and per layer; None: no limit).
    ``Planning``: ``effort`` (one of ``eplb.EFFORTS``; None: ``"default"``), ``work_budget``
    (an integer >= 0, work units per layer; None: the effort's), ``time_limit_s`` (seconds >
    0; None: the service's cap of half the trigger interval, else none). A value outside
    these raises ``ValueError`` naming the argument, before anything is sent; which policies
    take which option is the service's check (``INVALID_ARGUMENT`` on the field).

    Planning for time: ``kernel_model`` (a shipped model's name, ``eplb.kernel.shipped()``),
    ``tokens_per_gpu`` (the batch sizes; empty: those the reports' steps show), ``top_k``
    (None: 8), ``dispatch`` (``"even"`` or ``"static"``; None: even), and ``max_payback_steps`` (the
    trigger's time gate, ``Trigger.max_payback_steps``); the service checks them."""
    _check_migration(tolerance, layer_tolerance, max_moves, max_layer_moves)
    _check_planning(effort, work_budget, time_limit_s)
    msg = pb.Deployment(
        name=name, topology=topology_to_pb(topology), policy=policy, ranks=list(ranks), expert_bytes=expert_bytes
    )
    if half_life_s is not None and window_s is not None:
        # Both named: a caller who meant a sliding window silently got a decay one.
        raise ValueError(f"give window_s ({window_s}) or half_life_s ({half_life_s}), not both")
    if half_life_s is not None:
        msg.window.decay.half_life.FromNanoseconds(int(half_life_s * 1e9))
    elif window_s is not None:
        msg.window.sliding.duration.FromNanoseconds(int(window_s * 1e9))
    msg.trigger.interval.FromNanoseconds(int(interval_s * 1e9))
    msg.trigger.report_count = report_count
    msg.trigger.min_gain_percent = min_gain_percent
    for field, value in (
        ("tolerance", tolerance),
        ("layer_tolerance", layer_tolerance),
        ("max_moves", max_moves),
        ("max_layer_moves", max_layer_moves),
    ):
        if value is not None:
            setattr(msg.migration, field, value)
    if effort is not None:
        msg.planning.effort = effort
    if work_budget is not None:
        msg.planning.work_budget = work_budget
    if time_limit_s is not None:
        msg.planning.time_limit.FromNanoseconds(int(time_limit_s * 1e9))
    if switch_margin_steps is not None:
        msg.switch_margin_steps = switch_margin_steps
    if kernel_model is not None:
        msg.planning.kernel_model = kernel_model
    msg.planning.tokens_per_gpu.extend(int(b) for b in tokens_per_gpu)
    if top_k is not None:
        msg.planning.top_k = top_k
    if dispatch is not None:
        msg.planning.dispatch = dispatch
    if max_payback_steps is not None:
        msg.trigger.max_payback_steps = max_payback_steps
    return msg


def _check_migration(
    tolerance: float | None, layer_tolerance: float | None, max_moves: int | None, max_layer_moves: int | None
) -> None:
    """The service's rules for ``Migration``: the library's, with finite tolerances (a tolerance
    of None is the service's default; a move budget of None, no limit)."""
    defaults = eplb.Migration()
    for arg, value in (("tolerance", tolerance), ("layer_tolerance", layer_tolerance)):
        if value is not None:
            eplb.Migration.check_field(arg, value, finite=True, none=f"the service's default, {getattr(defaults, arg)}")
    for arg, value in (("max_moves", max_moves), ("max_layer_moves", max_layer_moves)):
        if value is not None:
            eplb.Migration.check_field(arg, value)


def _check_planning(effort: str | None, work_budget: int | None, time_limit_s: float | None) -> None:
    """The service's rules for ``Planning``: a known effort, an unsigned work budget, a time
    limit > 0 (a finite one: the wire's Duration has no infinity)."""
    if effort is not None:
        checks.one_of("effort", effort, eplb.EFFORTS, none="the service's default, 'default'")
    if work_budget is not None:
        checks.nonneg_int("work_budget", work_budget, "work units per layer", none="the effort's")
    if time_limit_s is not None:
        checks.positive_number(
            "time_limit_s", time_limit_s, finite=True, allowed="a finite number of seconds > 0 or None (no limit)"
        )


def check_health(channel: grpc.Channel, timeout_s: float = 2.0, service: str = SERVICE_NAME) -> bool:
    """Whether the service behind ``channel`` answers the standard gRPC health check as SERVING
    (a replica whose store is down answers NOT_SERVING; an unreachable one fails the call)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING

"""``Compute``: stateless plans (``ComputePlacement``): loads in, a placement out, on the bounded
pool of stateless calls (:meth:`.solver.Solver.compute`); no deployment, no store."""

from __future__ import annotations

import numpy as np

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

from . import arrays, codec, validation
from .errors import FieldViolation, InvalidArgument
from .solver import Job, Solver

__all__ = ["Compute", "topology_tuple"]


class Compute:
    """Stateless plans on ``solver``'s compute workers."""

    def __init__(self, solver: Solver) -> None:
        self.solver = solver

    async def placement(
        self, request: pb.ComputePlacementRequest, deadline_s: float | None
    ) -> pb.ComputePlacementResponse:
        """Stateless: ``loads [L, E]`` (+ optional ``previous_phy2log [L, P]``) → a plan, on the
        bounded compute pool, within ``deadline_s`` (the caller's time left; None: none)."""
        times = validation.check_times(request)
        if times:
            raise InvalidArgument(times)
        topo = validation.topology_from(request.topology, "topology")
        validation.check_plan_memory(topo, "topology")
        policy = validation.check_policy(request.policy, "policy")
        loads = arrays.decode_counts(request.loads, "loads", (topo.num_layers, topo.num_experts))
        violations = validation.check_migration(request.migration, policy, "migration")
        violations += validation.check_planning(request.planning, policy, "planning", topo.num_experts)
        if violations:
            raise InvalidArgument(violations)
        if policy == "ilp":
            validation.check_ilp_size(topo, "topology")
        previous = None
        if request.HasField("previous_phy2log"):
            previous = arrays.decode(
                request.previous_phy2log, "previous_phy2log", (topo.num_layers, topo.num_slots), kinds="iu"
            )
            try:
                eplb.Placement(previous, topo)
            except ValueError as exc:
                raise InvalidArgument(FieldViolation("previous_phy2log", str(exc))) from None
            previous = previous.astype(np.int32)
        options = codec.migration_options(request.migration, policy) if previous is not None else {}
        if previous is not None and (previous < 0).all(axis=0).reshape(topo.num_gpus, -1).all(axis=1).any():
            # A previous placement with gpus down: they stay down (their slots empty).
            options["down_gpus"] = list(eplb.Placement(previous, topo).down_gpus)
        planning, notes = codec.planning_options(request.planning, policy, topo.num_layers, deadline_s), []
        job = Job(
            np.asarray(loads, dtype=np.float64),
            topology_tuple(topo),
            policy,
            previous,
            {**options, **planning},
            expert_bytes=request.expert_bytes if previous is not None else 0,
        )
        solved = await self.solver.compute(job, deadline_s)
        solved.stats.notes.extend(notes)
        return pb.ComputePlacementResponse(
            phy2log=encode(solved.phy2log), logcnt=encode(solved.logcnt), stats=solved.stats
        )


def topology_tuple(topo: eplb.Topology) -> tuple[int, int, int, int, int, int]:
    """``topo`` as the tuple a :class:`.solver.Job` carries to a worker."""
    return (topo.num_layers, topo.num_experts, topo.num_slots, topo.num_gpus, topo.num_nodes, topo.num_groups)

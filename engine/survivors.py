"""The survivor placement every live rank computes by itself when a rank dies and the service
is unreachable: the same call the service makes for ``SetRanksDown``.

``survivor_plan(base, down_gpus)`` plans from the last placement every rank has (``base``) and
the gpus down: ``eplb.rebalance(loads, topology, "auto", previous=base.placement,
down_gpus=down_gpus, effort="fast")`` with ``loads`` the base version's snapshot
(``Placement.loads``; ones when it carries none). The library's plans are deterministic (a work
budget, no time limit), so every survivor gets the same placement, and the service's own
survivor placement for the same (base version, down set) is identical (``same_survivor``):
a rank that switched to its local one takes the service's version without moving a weight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

import eplb
from eplb.survivor_rules import EPLB_VERSION, SURVIVOR_OPTIONS, SURVIVOR_POLICY

if TYPE_CHECKING:
    # .wire imports grpc; the mover imports GroupMismatch from here and must not need it.
    from .wire import PublishedPlacement


class GroupMismatch(ValueError):
    """The mover's process group does not hold the gpus a placement puts experts on: after a
    death, a version planned for the whole group that reaches the survivors' group."""


__all__ = ["SURVIVOR_OPTIONS", "SURVIVOR_POLICY", "GroupMismatch", "same_survivor", "survivor_plan"]

log = logging.getLogger(__name__)


def survivor_plan(
    base: PublishedPlacement, down_gpus: Sequence[int], down_ranks: Sequence[int] | None = None
) -> PublishedPlacement:
    """``base`` (``[L, P]``, its loads ``[L, E]`` if it has them) and the gpus down → the
    survivor placement, as version ``base.version + 1`` with ``survivor_of = base.version``
    (the service may publish its own under another number: compare with ``same_survivor``).

    ``down_gpus`` are the gpus down now (those already down in ``base`` included: pass the
    whole set); ``down_ranks``: their ranks (default: the gpu ids, ranks = gpus). Raises
    ``ValueError`` (the library's) when too few live slots remain for every expert.
    """
    from .wire import PublishedPlacement  # here, not at the top: see the TYPE_CHECKING import

    topo = base.placement.topology
    mine = EPLB_VERSION
    if base.eplb_version and base.eplb_version != mine:
        log.warning(
            "version %d was planned with eplb %s and this rank runs eplb %s: its survivor placement may differ "
            "from the service's and the other ranks' (ranks on one release agree with each other)",
            base.version,
            base.eplb_version,
            mine,
        )
    down = sorted(int(g) for g in down_gpus)
    loads = base.loads if base.loads is not None else np.ones((topo.num_layers, topo.num_experts))
    plan = eplb.rebalance(loads, topo, SURVIVOR_POLICY, previous=base.placement, down_gpus=down, **SURVIVOR_OPTIONS)
    stats = type(base.stats)()
    stats.policy, stats.policy_used = SURVIVOR_POLICY, plan.policy_used
    stats.imbalance_after = plan.mean_imbalance
    stats.moves = plan.total_moves
    stats.notes.extend([*plan.notes, f"survivor plan computed on this rank from version {base.version}"])
    return PublishedPlacement(
        base.deployment,
        base.version + 1,
        plan.placement,
        stats,
        down_ranks=tuple(sorted(int(r) for r in (down if down_ranks is None else down_ranks))),
        down_ranks_version=base.version + 1,
        survivor_of=base.version,
        loads=base.loads,
        eplb_version=mine,
    )


def same_survivor(local: PublishedPlacement, published: PublishedPlacement) -> bool:
    """Whether the service's ``published`` placement is the survivor placement this rank
    computed (``local``): the same base version, down ranks and map. A mismatch (another eplb
    version on the service, say) is logged: the ranks then move to the service's placement."""
    same = (
        published.survivor_of == local.survivor_of
        and published.down_ranks == local.down_ranks
        and np.array_equal(published.placement.phy2log, local.placement.phy2log)
    )
    if not same and published.survivor_of == local.survivor_of and published.down_ranks == local.down_ranks:
        log.warning(
            "the service's survivor placement (version %d) differs from this rank's for base version %d and "
            "down ranks %s: is the service on another eplb version? moving to the service's",
            published.version,
            local.survivor_of,
            list(local.down_ranks),
        )
    return same

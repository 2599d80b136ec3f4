"""Rollouts: where each engine rank stands with a placement version, and the switch step.

An engine rank acknowledges a version in up to three states (``AckState``): PREPARED (its new
weights are in place, it still routes with the previous map), SWITCHED (it routes with the
version's map) and FAILED (preparing failed; it keeps the previous map). Once every rank of
the deployment prepared a version, the service fixes the version's switch step, the largest
PREPARED step plus ``switch_margin_steps``; every rank switches at that step. The switch step is
stored, so every instance answers the same one. A FAILED ack before the switch step is fixed
aborts the version's rollout; after it, the step stands (some ranks may already route with the
version) and the failure is only counted.

The Redis store applies these rules in one Lua script; :func:`apply_ack` is the same rules on
plain dicts, for the in-process store and for unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

__all__ = [
    "DEFAULT_SWITCH_MARGIN",
    "FAILED",
    "PREPARED",
    "SWITCHED",
    "RankState",
    "Rollout",
    "VersionRollout",
    "apply_ack",
    "version_counts",
]

PREPARED, SWITCHED, FAILED = pb.ACK_STATE_PREPARED, pb.ACK_STATE_SWITCHED, pb.ACK_STATE_FAILED
DEFAULT_SWITCH_MARGIN = 8


@dataclass(frozen=True)
class RankState:
    """One rank's latest versions: switched to, prepared (or switched to), failed (0: none)."""

    switched: int = 0
    prepared: int = 0
    failed: int = 0


@dataclass
class VersionRollout:
    """What a store keeps per version: the largest PREPARED step, the fixed switch step, abort."""

    max_step: int = -1
    switch_step: int | None = None
    aborted: bool = False


@dataclass(frozen=True)
class Rollout:
    """A version's rollout after one ack, and what this ack completed (``became_*``)."""

    ranks_acked: int
    ranks_prepared: int
    ranks_failed: int
    num_ranks: int
    switch_step: int
    aborted: bool
    became_prepared: bool = False
    became_switched: bool = False
    became_failed: bool = False

    def to_pb(self) -> pb.AckPlacementResponse:
        return pb.AckPlacementResponse(
            ranks_acked=self.ranks_acked,
            ranks_prepared=self.ranks_prepared,
            ranks_failed=self.ranks_failed,
            num_ranks=self.num_ranks,
            switch_step=self.switch_step,
            aborted=self.aborted,
        )


def apply_ack(
    states: dict[int, RankState],
    versions: dict[int, VersionRollout],
    rank: int,
    version: int,
    state: int,
    step: int,
    ranks: list[int],
    margin: int,
) -> Rollout:
    """Records one ack in ``states`` (rank → RankState) and ``versions`` (version → its rollout),
    in place, and returns the rollout of ``version`` over ``ranks``. ``state`` 0 means SWITCHED."""
    old = states.get(rank, RankState())
    new = old
    vr = versions.setdefault(version, VersionRollout())
    if state in (SWITCHED, 0):
        new = RankState(max(old.switched, version), old.prepared, old.failed)
    elif state == PREPARED:
        new = RankState(old.switched, max(old.prepared, version), old.failed)
        vr.max_step = max(vr.max_step, step)
    elif state == FAILED:
        new = RankState(old.switched, old.prepared, max(old.failed, version))
    states[rank] = new
    acked, prepared, failed = version_counts(states, ranks, version)
    # A fixed switch step stands: ranks may already route with the version, so a late failure
    # is counted (ranks_failed) but aborts nothing.
    aborts = state == FAILED and vr.switch_step is None
    became_failed = aborts and not vr.aborted
    vr.aborted = vr.aborted or aborts
    became_prepared = vr.switch_step is None and not vr.aborted and prepared == len(ranks)
    if became_prepared:
        vr.switch_step = max(vr.max_step, 0) + margin
    became_switched = state in (SWITCHED, 0) and old.switched < version and acked == len(ranks)
    return Rollout(
        acked,
        prepared,
        failed,
        len(ranks),
        0 if vr.aborted or vr.switch_step is None else vr.switch_step,
        vr.aborted,
        became_prepared,
        became_switched,
        became_failed,
    )


def version_counts(states: dict[int, RankState], ranks: list[int], version: int) -> tuple[int, int, int]:
    """``(acked, prepared, failed)``: how many of ``ranks`` switched to ``version`` (or later),
    prepared (or switched to) it, and failed it; the counts :func:`apply_ack` answers."""
    acked = prepared = failed = 0
    for r in ranks:
        s = states.get(r, RankState())
        acked += s.switched >= version
        prepared += max(s.switched, s.prepared) >= version
        failed += s.failed == version
    return acked, prepared, failed

"""Rollouts of several deployments on the same ranks (a target model and its draft), agreed
by one all-reduce a step: ``RolloutGroup`` and its one joining rule (``_together``)."""

from __future__ import annotations

from collections.abc import Sequence

from ..wire import PublishedPlacement
from .barriers import Decision, Local, ProcessGroupBarrier
from .machine import Rollout

__all__ = ["RolloutGroup"]


class RolloutGroup:
    """Rollouts of several deployments on the same ranks, agreed by one all-reduce a step: a
    target model and its draft (MTP, speculative decoding), each with its own experts, slots,
    loads and versions. Each rollout keeps its own ``ProcessGroupBarrier`` (for its acks; all
    on one group) and applier; the service keeps nothing across them.

    Each deployment starts, prepares, switches chunks and aborts as on its own, with one rule
    joining them: **a version's last switch waits while another deployment is changing** (a
    version in flight, agreed to start, or offered on some rank), and then both switch at the
    same step. So when both change they switch together; when one changes alone it switches
    alone; when one fails, the other goes on. A deployment kept waiting so does not time out
    for it (its wait restarts); a version offered on some ranks but never reaching the others
    keeps the other deployment waiting, as it would keep its own from starting.
    """

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        if not rollouts:
            raise ValueError("a RolloutGroup needs at least one rollout")
        barriers = [r.barrier for r in rollouts]
        if not all(isinstance(b, ProcessGroupBarrier) for b in barriers):
            kinds = sorted({type(b).__name__ for b in barriers})
            raise ValueError(
                f"a RolloutGroup agrees its switches through the engine's process group: every rollout needs a "
                f"ProcessGroupBarrier, got {', '.join(kinds)}"
            )
        if any(b.group is not barriers[0].group for b in barriers):
            raise ValueError("every rollout of a RolloutGroup needs its ProcessGroupBarrier on the same group")
        if len({id(b) for b in barriers}) != len(barriers):
            raise ValueError("each rollout of a RolloutGroup needs a ProcessGroupBarrier of its own (its acks)")
        self.rollouts = tuple(rollouts)

    def step(self, step: int) -> list[PublishedPlacement]:
        """At a step boundary: advances every rollout; returns each one's placement to route with."""
        # The group stands in for each rollout's own step(): it takes every rollout's side, agrees
        # them in one all-reduce, and hands each rollout its decision (Rollout._local, _apply).
        locals_ = [r._local() for r in self.rollouts]
        barriers = [r.barrier for r in self.rollouts]
        reduced = barriers[0].reduce(locals_)
        decisions = [ProcessGroupBarrier.decide(local, v) for local, v in zip(locals_, reduced)]
        decisions = _together(decisions, locals_, reduced)
        for barrier, local, decision in zip(barriers, locals_, decisions):
            barrier.report(step, local, decision)
        return [r._apply(step, d) for r, d in zip(self.rollouts, decisions)]

    def close(self, timeout_s: float = 2.0) -> None:
        for rollout in self.rollouts:
            rollout.close(timeout_s)


def _together(decisions: list[Decision], locals_: list[Local], reduced: list[list[int]]) -> list[Decision]:
    """``RolloutGroup``'s rule: a last switch holds while another deployment is changing and
    not switching its own last chunk at this step. Drawn from the reduced values and the agreed
    decisions only, so every rank holds alike."""
    finishing = [d.switch and local.final for d, local in zip(decisions, locals_)]
    changing = [v[2] > 0 or d.start != 0 or v[0] > local.current for d, local, v in zip(decisions, locals_, reduced)]
    out = []
    for i, decision in enumerate(decisions):
        held = finishing[i] and any(changing[j] and not finishing[j] for j in range(len(decisions)) if j != i)
        out.append(Decision(hold=True) if held else decision)
    return out

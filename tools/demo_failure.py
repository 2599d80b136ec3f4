"""``eplb demo --fail-rank R --fail-at STEP``: a rank killed mid-run, the survivors carrying on.

The demo's parent process hosts the gloo rendezvous store (a ``TCPStore``), so any rank can
die. At the start of step STEP rank R hands the parent its tallies and waits; the parent
SIGKILLs it, sees it gone, and marks it down in the store (``eplb_engine.membership``: the
parent is the supervisor).

Every step each rank first joins a heartbeat (``membership.detect_down``: an all-reduce it
polls, so no rank blocks in a collective with a dead peer). Once the rank is marked down the
survivors rebuild their groups over the live ranks (``new_group(live,
use_local_synchronization=True)``: the dead rank takes no part) and call
``BalancedRank.ranks_down``: the transition in flight is dropped, the survivor placement every
survivor computes alike is offered, the experts whose every replica was on the dead rank come
back through the loader (``HostExpertBackup``: host copies of the experts at risk, the
"checkpoint" behind them), and the service hears of it (``SetRanksDown``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Failure", "lost_experts"]


def lost_per_layer(phy2log: np.ndarray, slots_per_gpu: int, dead: list[int]) -> np.ndarray:
    """``phy2log [L, P]`` → ``[L]``: per layer, the experts with every replica on ``dead`` gpus."""
    L, P = phy2log.shape
    E = int(phy2log.max()) + 1 if phy2log.size else 0
    on_dead = np.isin(np.arange(P) // slots_per_gpu, dead)
    rows = np.broadcast_to(np.arange(L)[:, None], phy2log.shape)

    def held(cols: np.ndarray) -> np.ndarray:  # [L, E]: the expert has a replica in those slots
        out = np.zeros((L, E + 1), dtype=bool)
        out[rows, np.where(cols & (phy2log >= 0), phy2log, E)] = True
        return out[:, :E]

    return (held(on_dead) & ~held(~on_dead)).sum(axis=1)


def lost_experts(phy2log: np.ndarray, slots_per_gpu: int, dead: list[int]) -> int:
    """``phy2log [L, P]`` → how many (layer, expert) pairs have every replica on ``dead`` gpus."""
    return int(lost_per_layer(phy2log, slots_per_gpu, dead).sum())


@dataclass
class Failure:
    """One survivor's view of a death: when it learnt of it, when its routing stopped reaching
    the dead rank, and what was lost in between."""

    dead: list[int]
    step: int  # the step at whose heartbeat the death was found
    detected_wall: float  # time.time() then (the parent's kill time is on the same clock)
    experts_lost: int  # (layer, expert) pairs whose every replica was on the dead ranks
    survivor_version: int  # the one offered here; the service's may replace it (the same map)
    recovered_step: int = -1  # first step routed with no slot on a dead rank (-1: not yet)
    recovered_wall: float = 0.0
    recovered_version: int = 0  # the version routed from recovered_step
    dispatches_lost: int = 0  # this rank's dispatches to the dead ranks' slots before that
    dispatches_to_dead_after: int = 0  # ... and after it (must stay 0)
    regroup_s: float = 0.0  # rebuilding the groups and ranks_down
    rejoined_step: int = -1  # --rejoin-at: the step from which the dead rank serves again
    dispatches_to_rejoined: int = 0  # this rank's dispatches to its slots from then on
    # Per layer, the experts lost in the last map routed before that layer left the dead
    # rank: what the survivor move restores. It differs from experts_lost when a version
    # switches between the death and the survivor placement (service barrier: a switch step
    # fixed before the death stands), which may have copied some of them to the survivors.
    lost_at_switch: np.ndarray | None = None

    def routed(self, step: int, hist: np.ndarray, routed: object, slots_per_gpu: int) -> None:
        """``hist [L, P, E]``: this rank's dispatches of ``step``, routed with ``routed`` (a
        ``PublishedPlacement``, mixed or not)."""
        dead_slots = np.concatenate([np.arange(r * slots_per_gpu, (r + 1) * slots_per_gpu) for r in self.dead])
        to_dead = int(hist[:, dead_slots].sum())
        if self.recovered_step < 0:
            phy2log = routed.placement.phy2log
            lost = lost_per_layer(phy2log, slots_per_gpu, self.dead)
            leaving = (phy2log[:, dead_slots] >= 0).any(axis=1)  # still routes to the dead rank
            self.lost_at_switch = np.where(leaving, lost, 0 if self.lost_at_switch is None else self.lost_at_switch)
        if 0 <= self.rejoined_step <= step:  # restarted and planned in: served again
            self.dispatches_to_rejoined += to_dead
            return
        if self.recovered_step < 0 and not (routed.placement.phy2log[:, dead_slots] >= 0).any():
            self.recovered_step, self.recovered_wall, self.recovered_version = step, time.time(), routed.version
        if self.recovered_step < 0:
            self.dispatches_lost += to_dead
        else:
            self.dispatches_to_dead_after += to_dead

    def as_dict(self) -> dict:
        return {
            "dead": self.dead,
            "step": self.step,
            "detected_wall": self.detected_wall,
            "experts_lost": self.experts_lost,
            "survivor_version": self.survivor_version,
            "recovered_step": self.recovered_step,
            "recovered_wall": self.recovered_wall,
            "recovered_version": self.recovered_version,
            "dispatches_lost": self.dispatches_lost,
            "dispatches_to_dead_after": self.dispatches_to_dead_after,
            "regroup_s": self.regroup_s,
            "rejoined_step": self.rejoined_step,
            "dispatches_to_rejoined": self.dispatches_to_rejoined,
            "experts_lost_at_switch": int(self.lost_at_switch.sum()) if self.lost_at_switch is not None else 0,
        }


def checkpoint(tensors: dict[str, tuple[int, ...]], code: Callable[[int, int, int], float]) -> Callable:
    """The demo's "checkpoint": ``(layer, expert) -> {name: one slot's tensor}``, each filled
    with ``code(layer, expert, t)`` (``t``: the tensor's index in name order)."""
    import torch

    def load(layer: int, expert: int) -> dict:
        return {
            name: torch.full(shape, float(code(layer, expert, t)), dtype=torch.float32)
            for t, (name, shape) in enumerate(sorted(tensors.items()))
        }

    return load


def summarize(
    cfg_fail_rank: int,
    cfg_fail_at: int,
    kill_wall: float,
    views: dict[int, dict],
    lead: int,
    rejoin: dict | None = None,
    restart_wall: float = 0.0,
) -> dict:
    """The summary's ``failures`` entry from every survivor's ``Failure`` (``views``, by rank)
    and the parent's kill time; timings from ``lead`` (they all switch at one agreed step).
    ``rejoin``: with --rejoin-at, the restarted rank's ``Rejoin`` (``None``: never restarted),
    ``restart_wall`` when the parent started it."""
    mine = views[lead]
    rec = mine["recovered_step"]
    out = {
        "rank": cfg_fail_rank,
        "step": cfg_fail_at,
        "recovered_step": rec,
        "recovery_s": round(mine["recovered_wall"] - kill_wall, 4) if rec >= 0 else None,
        "detect_s": round(mine["detected_wall"] - kill_wall, 4),
        "regroup_s": round(mine["regroup_s"], 4),
        "experts_lost": mine["experts_lost"],
        # counted against the map the survivor move started from: what it had to reload
        "experts_lost_at_switch": mine.get("experts_lost_at_switch", mine["experts_lost"]),
        "experts_reloaded": int(sum(v["restored"] for v in views.values())),
        "experts_from_host_copies": int(sum(v["restored_from_host"] for v in views.values())),
        "dispatches_lost": int(sum(v["dispatches_lost"] for v in views.values())),
        "dispatches_to_dead_after_recovery": int(sum(v["dispatches_to_dead_after"] for v in views.values())),
        "survivor_version": mine["recovered_version"] if rec >= 0 else mine["survivor_version"],
        "recovered_steps_agree": len({v["recovered_step"] for v in views.values()}) == 1,
    }
    if rejoin is not None:
        joined = rejoin["step"] >= 0
        out |= {
            "rejoined_step": rejoin["step"],
            # restart (the parent starting its process) to serving (the join done, routing on)
            "rejoin_s": round(rejoin["serving_wall"] - restart_wall, 4) if joined else None,
            "rejoin_ready_s": round(rejoin["ready_wall"] - restart_wall, 4),
            "rejoin_stall_s": round(rejoin["join_s"], 4),  # the step the survivors waited for the join
            "experts_loaded_on_rejoin": rejoin["experts_loaded"],
            "rejoin_moves": rejoin["moves"],
            "rejoin_version": rejoin["version"],
            "rejoined_steps_agree": {v["rejoined_step"] for v in views.values()} == {rejoin["step"]},
            "dispatches_to_rejoined": int(sum(v["dispatches_to_rejoined"] for v in views.values())),
            "dispatches_served_by_rejoined": rejoin["served"],
        }
    return out

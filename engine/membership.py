"""Rank membership over a ``torch.distributed`` store: which ranks are down, the process groups
of a membership epoch, and the word that lets a restarted rank join the survivors at one step.

Glossary:

- **supervisor**: whatever learns that a rank's process is gone (the demo's parent, a node
  agent, an orchestrator). It writes the down ranks into the store (``mark_down``); the ranks
  never guess a death from a timeout, so no slow rank is ever taken for a dead one.
- **heartbeat**: one tiny all-reduce per step on the steps' group, polled (``detect_down``), so
  no rank blocks in a collective with a dead peer.
- **epoch**: the membership after some number of changes. Epoch ``e``'s groups rendezvous under
  ``epoch{e}/`` in the store (``epoch_groups``), not under the default world's, so a restarted
  rank that is in no world with the survivors can build them with them.
- **join word**: what the survivors tell a restarted rank (``JoinWord``): the step from which
  every rank routes together again and the version the survivors route.

Everything here talks to a store the caller made (a ``TCPStore`` that outlives any one rank,
``PrefixStore``, ``HashStore``); torch is imported on first use, so the module imports without
it.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .wire import PublishedPlacement

__all__ = [
    "CANCEL_KEY",
    "DOWN_KEY",
    "GO_KEY",
    "READY_KEY",
    "EpochGroups",
    "JoinWord",
    "announce_join",
    "cancel_join",
    "detect_down",
    "epoch_groups",
    "joiner_ready",
    "mark_down",
    "mark_ready",
    "placeholder_world",
    "read_down",
    "wait_join",
]

DOWN_KEY = "down"  # the supervisor writes the down ranks here (a JSON list), once they are gone
READY_KEY = "rejoin/ready"  # a restarted rank is up and may be joined
GO_KEY = "rejoin/go"  # the survivors' JoinWord
CANCEL_KEY = "rejoin/cancel"  # the survivors stopped before the join: no JoinWord will come

CHECK_S = 0.005  # how often a heartbeat still waiting reads the store: detect_down's latency
_POLL_S = 0.0005  # how often it polls its collective: well under a 20 ms step


# ---- failure detection ----


def mark_down(store: Any, ranks: Iterable[int]) -> None:
    """The supervisor's word: ``ranks`` are gone (all of them so far, not only the newest). Write
    it only once their processes are dead, as the survivors rebuild their groups without them."""
    store.set(DOWN_KEY, json.dumps(sorted(int(r) for r in ranks)))


def read_down(store: Any) -> list[int] | None:
    """The ranks the supervisor marked down, sorted; ``None`` while it has marked none."""
    if not store.check([DOWN_KEY]):
        return None
    return sorted(int(r) for r in json.loads(store.get(DOWN_KEY).decode()))


def detect_down(group: Any, store: Any, *, death_wait_s: float = 30.0) -> list[int] | None:
    """One heartbeat on ``group`` (collective over its ranks): ``None`` when every rank joined it;
    the down ranks (``read_down``) when one never came.

    It never blocks in the collective: blocking would not do on gloo, where a dead peer's
    neighbours get "connection closed" at once but the other ranks of a 4-rank all-reduce wait
    out the group's timeout, and ``abort()`` from another thread does not wake them (both
    measured on torch 2.13, CPU). While the all-reduce has not completed it reads the store
    every ``CHECK_S`` seconds, so it returns within about ``CHECK_S`` of ``mark_down``. A rank
    whose all-reduce failed (a neighbour of the dead rank) waits up to ``death_wait_s`` for the
    supervisor's word, then raises ``RuntimeError``. After a death the group is spent: its
    abandoned all-reduce stays in it, so build the next groups without destroying it.

    It returns every rank marked so far, not only those in ``group``, and the mark stays: a
    heartbeat after the first death that waits longer than ``CHECK_S`` reads the same list, so
    a caller that carries on after a death must drop the ranks it already handled."""
    import torch
    import torch.distributed as dist

    work = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
    next_check = time.monotonic() + CHECK_S
    while not work.is_completed():
        now = time.monotonic()
        if now >= next_check:
            down = read_down(store)
            if down is not None:
                return down
            next_check = now + CHECK_S
        time.sleep(_POLL_S)
    try:
        work.wait()
        return None
    except RuntimeError:
        try:
            store.wait([DOWN_KEY], timedelta(seconds=death_wait_s))
        except RuntimeError as exc:
            raise RuntimeError(
                f"a heartbeat failed and no rank was marked down in the store within {death_wait_s} s: "
                "the supervisor must mark_down() the ranks it saw die"
            ) from exc
        return read_down(store)


# ---- membership epochs ----


@dataclass(frozen=True)
class EpochGroups:
    """The gloo groups of one membership epoch, each over every rank of it (group rank ``g`` is
    gpu ``g``): the steps' collectives, the rollout barrier's, the weight mover's."""

    steps: Any
    barrier: Any
    mover: Any


def epoch_groups(
    store: Any, epoch: int, rank: int, size: int, *, mover_timeout_s: float, timeout_s: float = 60.0
) -> EpochGroups:
    """Collective over ranks 0 .. ``size - 1``: epoch ``epoch``'s groups, each rendezvousing
    under ``PrefixStore("epoch{epoch}/...", store)``. Every member calls it with the same
    ``epoch`` and ``size``, and an epoch is built once (its keys stay in the store). The
    process needs a default process group of its own (a restarted rank makes a placeholder:
    ``placeholder_world``); ``rank`` is this process's rank in that world too. ``mover_timeout_s`` is the mover group's gloo timeout (short: a transfer
    in flight when a rank dies waits that long); ``timeout_s`` the other two's."""
    import torch.distributed as dist

    timeouts = {"steps": timeout_s, "barrier": timeout_s, "mover": mover_timeout_s}
    groups = {
        name: _gloo_group(dist.PrefixStore(f"epoch{epoch}/{name}", store), f"epoch{epoch}-{name}", rank, size, t)
        for name, t in timeouts.items()
    }
    return EpochGroups(**groups)


def _gloo_group(store: Any, name: str, rank: int, size: int, timeout_s: float) -> Any:
    """The one place torch privates are used. ``new_group()`` cannot make an epoch's group: it
    keys its rendezvous by the default world's store and members, and a restarted rank is in no
    world with the survivors. ``_new_process_group_helper`` takes a store of our choosing; the
    group-rank map is filled in as ``new_group`` would, so collectives on the group find it."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    helper = getattr(c10d, "_new_process_group_helper", None)
    world = getattr(c10d, "_world", None)
    if helper is None or not hasattr(world, "pg_group_ranks"):
        raise RuntimeError(
            f"eplb_engine.membership.epoch_groups needs torch.distributed's private "
            f"_new_process_group_helper and _world.pg_group_ranks, which torch {torch.__version__} "
            "does not have: install a torch eplb_engine supports (pyproject.toml's engine extra)"
        )
    pg, _ = helper(size, rank, list(range(size)), "gloo", store, group_name=name, timeout=timedelta(seconds=timeout_s))
    world.pg_group_ranks[pg] = {r: r for r in range(size)}
    return pg


# ---- the join of a restarted rank ----


def placeholder_world(rank: int, size: int) -> None:
    """On a restarted rank: a default process group that gives it ``rank`` of ``size`` and talks
    to no one (torch's ``fake`` backend), as ``epoch_groups`` needs one. The old world cannot be
    joined: its members left it long ago, and a gloo group cannot be joined late."""
    import torch
    import torch.distributed as dist

    try:
        # Registers the "fake" backend; torch ships it with its tests, so it is not public.
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"eplb_engine.membership.placeholder_world needs torch's fake process group "
            f"(torch.testing._internal.distributed.fake_pg), which torch {torch.__version__} does not have"
        ) from exc
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=size)


@dataclass(frozen=True)
class JoinWord:
    """The survivors' word to a restarted rank: from ``step`` on every rank routes together;
    ``base`` is the version the survivors route and ``routing`` int32 ``[L, P]`` the map they
    route (``base``'s, or a chunked rollout's mixed map)."""

    step: int
    base: PublishedPlacement
    routing: np.ndarray

    def to_bytes(self) -> bytes:
        # A generated message class does not pickle: the wire stats travel as their bytes.
        base = replace(self.base, stats=None)
        return pickle.dumps(
            {"step": self.step, "base": base, "stats": self.base.stats.SerializeToString(), "routing": self.routing}
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> JoinWord:
        from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

        d = pickle.loads(raw)
        return cls(d["step"], replace(d["base"], stats=pb.PlanStats.FromString(d["stats"])), d["routing"])


def mark_ready(store: Any) -> None:
    """On the restarted rank, once it can be joined (its engine side built)."""
    store.set(READY_KEY, "1")


def joiner_ready(store: Any) -> bool:
    """On a survivor: whether a restarted rank said ``mark_ready``."""
    return bool(store.check([READY_KEY]))


def announce_join(store: Any, word: JoinWord) -> None:
    """On one survivor (the lowest live rank, say), once every survivor agreed on ``word.step``."""
    store.set(GO_KEY, word.to_bytes())


def cancel_join(store: Any) -> None:
    """On one survivor, when the run ends before the join: the restarted rank stops waiting.
    Best effort: a store already gone is no error here."""
    with contextlib.suppress(Exception):
        store.set(CANCEL_KEY, "1")


def wait_join(store: Any, poll_s: float = 0.002) -> JoinWord | None:
    """On the restarted rank: blocks until the survivors' ``JoinWord`` (``None``: they called
    ``cancel_join``). It reads the store every ``poll_s`` seconds."""
    while True:
        if store.check([GO_KEY]):
            return JoinWord.from_bytes(store.get(GO_KEY))
        if store.check([CANCEL_KEY]):
            return None
        time.sleep(poll_s)

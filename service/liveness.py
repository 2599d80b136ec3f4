"""Liveness: which ranks of a deployment went quiet (``Deployment.liveness.suspect_after``).

A rank from which no instance received a report or an ack for longer than ``suspect_after`` is
**suspect**: ``DeploymentStatus.suspect_ranks`` (in ``GetDeployment`` and ``ListDeployments``)
lists it and ``eplb_suspect_ranks{deployment}`` counts it. It is only shown; the service never
plans a rank out on its own (``SetRanksDown`` does that), and a rank down is never suspect.

Several instances may serve one deployment, so the times they saw are shared through the store
(``Store.record_seen``, a hash per deployment on Redis): each instance notes the latest report or
ack time per rank in memory (:meth:`.local.LocalDeployment.saw`, no store call on the report path) and writes
the ones that changed every ``BalancerConfig.liveness_s`` (1 s), one call per deployment, each
time kept only where later than the stored one. Another instance's view of a rank is therefore up
to ``liveness_s`` old; a rank is listed only once it is silent for more than ``suspect_after +
liveness_s``, so one that is alive is never listed because of that lag (with the instances'
clocks in step), and a dead one is listed ``liveness_s`` late at most.
"""

from __future__ import annotations

import logging
import time

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import codec
from .errors import NotFound, StoreUnavailable
from .local import LocalDeployment
from .metrics import Metrics
from .registry import Registry
from .store import Seen, Store, created_seconds

__all__ = ["Liveness", "suspects"]

log = logging.getLogger(__name__)


def suspects(
    ranks: list[int], down: set[int], seen: Seen, created: float, after_s: float, margin_s: float, now: float
) -> list[pb.SuspectRank]:
    """The ranks of ``ranks`` not in ``down`` silent for longer than ``after_s + margin_s`` at
    ``now`` (seconds since the epoch), sorted. A rank never seen counts from ``seen.start``
    (``created``, the deployment's create time, when the store has no start)."""
    start = seen.start or created
    out = []
    for rank in sorted(ranks):
        if rank in down:
            continue
        last = seen.ranks.get(rank)
        since = max(0.0, now - (start if last is None else last))
        if since > after_s + margin_s:
            out.append(pb.SuspectRank(rank=rank, seconds_since_seen=since, ever_seen=last is not None))
    return out


class Liveness:
    """Last-seen times of the ranks of ``registry``'s deployments, and the suspect ones.
    ``liveness_s``: how often :meth:`run` writes them (``BalancerConfig.liveness_s``)."""

    def __init__(self, registry: Registry, store: Store, metrics: Metrics, liveness_s: float) -> None:
        self.registry = registry
        self.store = store
        self.metrics = metrics
        self.liveness_s = liveness_s

    async def write_seen(self, local: LocalDeployment) -> None:
        """Writes the times ``local`` saw since the last write (kept for the next on failure)."""
        if not local.seen_unwritten:
            return
        batch, local.seen_unwritten = local.seen_unwritten, {}
        try:
            await self.store.record_seen(local.deployment.name, batch)
        except BaseException:
            # Kept for the next round (a later time of the same rank wins).
            for rank, at in batch.items():
                local.seen_unwritten[rank] = max(at, local.seen_unwritten.get(rank, 0.0))
            raise

    async def suspects(
        self, deployment: pb.Deployment, down: set[int], local: LocalDeployment | None
    ) -> list[pb.SuspectRank]:
        """The suspect ranks of ``deployment`` (those in ``down`` excluded): the store's times,
        merged with this instance's own when it follows the deployment (``local``: a rank that
        just reported here is live at once)."""
        after_s = codec.suspect_after_s(deployment)
        if not after_s:
            return []
        seen = await self.store.seen(deployment.name)
        if local is not None and local.deployment.create_time == deployment.create_time:
            for rank, at in local.seen.items():
                if at > seen.ranks.get(rank, 0.0):
                    seen.ranks[rank] = at
        return suspects(
            codec.deployment_ranks(deployment),
            down,
            seen,
            created_seconds(deployment),
            after_s,
            self.liveness_s,
            time.time(),
        )

    async def run(self) -> None:
        """Writes the times seen since the last round, and re-counts every deployment's suspect
        ranks for ``eplb_suspect_ranks`` (logging a change of them). Deployments without
        liveness cost nothing here."""
        unavailable: StoreUnavailable | None = None
        for name, local in list(self.registry.local.items()):
            if not local.suspect_after_s or local.hub.deleted:
                continue
            try:
                await self.write_seen(local)
                latest = self.registry.latest(name)
                found = await self.suspects(
                    local.deployment, set(latest.down_ranks) if latest is not None else set(), local
                )
            except NotFound:
                continue
            except StoreUnavailable as exc:
                unavailable = exc  # on Redis Cluster one master's deployments fail, the others go on
                continue
            if self.registry.local.get(name) is not local:
                continue  # deleted (or re-created) meanwhile: its series are gone
            self.metrics.suspect_ranks.labels(name).set(len(found))
            ranks = frozenset(s.rank for s in found)
            if ranks != local.suspect:
                if ranks - local.suspect:
                    log.warning(
                        "%s: ranks %s suspect: no report or ack for over %gs (liveness.suspect_after); "
                        "they stay planned in until SetRanksDown marks them down",
                        name,
                        sorted(ranks - local.suspect),
                        local.suspect_after_s,
                    )
                if local.suspect - ranks:
                    log.info("%s: ranks %s no longer suspect", name, sorted(local.suspect - ranks))
                local.suspect = ranks
        if unavailable is not None:
            raise unavailable

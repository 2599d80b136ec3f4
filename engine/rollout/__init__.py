"""Applying a placement at a step boundary, on every rank at once.

A new map is only correct once every rank routes with it from the same step on, and only
after every weight it routes to has arrived. ``Rollout`` runs that protocol on one rank:

1. **offer**: the watcher hands over a new version (any thread; the latest wins);
2. **prepare**: on a worker thread, the ``Applier`` moves weights for the new map while the
   engine keeps routing with the old one (it must not disturb a slot the old map routes to:
   it stages the incoming weights and writes them at commit);
3. **ready**: the rank says it prepared (an ``ACK_STATE_PREPARED`` ack, or a flag in an
   all-reduce);
4. **switch**: once every rank is ready, all of them switch at one agreed step: ``commit``
   writes the staged weights and ``step()`` returns the new map from that step on;
5. **roll back**: a prepare that fails or runs past ``timeout_s``, or a rank that reports
   failure, makes every rank ``rollback`` and keep the old map; the failure is acked as
   ``ACK_STATE_FAILED`` with the error, which the service counts.

Each rank's side is a state machine (``Phase``: idle, preparing, ready, failed, reverting; the
transitions are listed at ``_TRANSITIONS`` and ``Rollout._enter`` is the only place the phase
changes). Everything happens on the step thread at step boundaries; the prepare is a future on
the rollout's one-worker executor, whose outcome the step thread reads once.

The agreement comes from a ``Barrier``, two of which are here: ``ServiceBarrier`` (through
the service's ``AckPlacement``: the switch step is the largest PREPARED step plus the
deployment's ``switch_margin_steps``) and ``ProcessGroupBarrier`` (through the engine's own
``torch.distributed`` group: an all-reduce at each step boundary; the switch is the step at
which the all-reduce shows every rank ready). docs/rollout.md compares them.

**Chunks.** A ``ChunkedApplier`` (``MoverApplier``, with its memory budget ``staging_bytes``)
may switch a version in chunks of layers: prepare chunk k, switch its layers at an agreed step, then
chunk k + 1. Each MoE layer routes with its own map, so between chunks the routing map
(``Rollout.routing``) takes the switched layers from the new placement and the others from
the old, and every layer's weights match its own map. Only ``ProcessGroupBarrier`` agrees
a step per chunk; ``ServiceBarrier`` switches whole versions (one agreed step per version)
and fails a prepare that needs several chunks. If a chunk fails after earlier chunks
switched, every rank moves those layers back (a reverse transition, chunked the same way) so
that the ranks end on the version the service knows; only if that fails too is the map left
mixed (a ``"partial"`` event), and the next version moves from the mixed map.

The modules, one job each: ``intake`` (``VersionIntake``: offers, supersede rules and local
survivor placements, resolved into the one version to roll out next), ``machine`` (``Rollout``,
``Phase``, ``RolloutEvent``: the phase machine, which takes that version), ``barriers`` (``Barrier``, ``Local``, ``Decision``, ``ServiceBarrier``,
``ProcessGroupBarrier``, ``AckSender``: how the ranks agree), ``group`` (``RolloutGroup``:
several deployments on one all-reduce), ``appliers`` (``Applier``, ``ChunkedApplier``,
``MoverApplier``: what moves the weights). The public names are imported from here.
"""

from __future__ import annotations

from .appliers import DEFAULT_STAGING_BYTES, Applier, ChunkedApplier, MoverApplier
from .barriers import AckSender, Barrier, Decision, Local, ProcessGroupBarrier, ServiceBarrier
from .group import RolloutGroup
from .machine import Phase, Rollout, RolloutEvent

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "Applier",
    "ChunkedApplier",
    "MoverApplier",
    "Phase",
    "Barrier",
    "Local",
    "Decision",
    "RolloutEvent",
    "Rollout",
    "ServiceBarrier",
    "ProcessGroupBarrier",
    "RolloutGroup",
    "AckSender",
]

"""``VersionIntake`` alone: which version a rank's rollout moves to next, from the service's
offers, this rank's own survivor placements and the refusals, with no machine, barrier or
process group (the phase machine only reads ``next_version`` and applies a ``Resolution``)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

import eplb
from eplb_engine.rollout.intake import Resolution, Resolve, VersionIntake
from eplb_engine.wire import PublishedPlacement
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(num_layers=2, num_experts=4, num_slots=6, num_gpus=2)


def version(number: int, *, seed: int | None = None, survivor_of: int = 0, down: tuple[int, ...] = ()):
    """Version ``number`` with a map drawn from ``seed`` (default: the number): two versions
    drawn from one seed have the same map."""
    rng = np.random.default_rng(number if seed is None else seed)
    phy2log = np.concatenate([rng.permutation(4), rng.integers(0, 4, 2)])[None].repeat(2, axis=0)
    placement = eplb.Placement(phy2log, TOPO)
    return PublishedPlacement("d1", number, placement, pb.PlanStats(), down_ranks=down, survivor_of=survivor_of)


def survivor(base: PublishedPlacement, number: int | None = None, *, seed: int = 100, down=(1,)):
    """A survivor placement of ``base`` (down ranks ``down``), numbered ``base + 1`` by default."""
    return version(base.version + 1 if number is None else number, seed=seed, survivor_of=base.version, down=down)


class Machine:
    """Stands in for ``Rollout``: it owns ``current``, which the intake only reads."""

    def __init__(self, current: PublishedPlacement) -> None:
        self.current = current
        self.intake = VersionIntake(lambda: self.current)


def resolve(intake: VersionIntake) -> Resolution | None:
    """What the machine's step thread gets from ``resolving`` (a REBASE applied inside it)."""
    with intake.resolving() as resolution:
        return resolution


def next_number(intake: VersionIntake) -> int | None:
    following = intake.next_version()
    return None if following is None else following.version


# -- offers from the service --------------------------------------------------------------


def offered_local() -> tuple[PublishedPlacement, Machine, PublishedPlacement]:
    """A machine on version 1 whose rank offered its own survivor plan of it: (base, machine, plan)."""
    base = version(1)
    m = Machine(base)
    local = survivor(base)
    m.intake.offer(local, supersede=True)
    return base, m, local


def test_nothing_offered_is_no_next_version():
    m = Machine(version(1))
    assert m.intake.next_version() is None and resolve(m.intake) is None and m.intake.local_survivor is None


def test_the_latest_offer_wins_and_older_or_current_ones_are_dropped():
    m = Machine(version(2))
    m.intake.offer(version(2))  # the version routed now
    assert m.intake.next_version() is None
    v4 = version(4)
    m.intake.offer(v4)
    m.intake.offer(version(3))  # older than the one offered: dropped
    assert m.intake.next_version() is v4
    v5 = version(5)
    m.intake.offer(v5)
    assert m.intake.next_version() is v5


def test_an_offer_is_judged_against_the_current_version_at_the_time():
    m = Machine(version(1))
    m.current = version(3)  # the machine switched on (its current is read under the intake's lock)
    m.intake.offer(version(3))
    assert m.intake.next_version() is None


def test_a_refused_version_is_not_offered_again_a_newer_one_is():
    m = Machine(version(1))
    m.intake.offer(version(2))
    m.intake.refuse(2)
    assert m.intake.next_version() is None
    m.intake.offer(version(2, seed=7))  # the same number again (another watcher delivery): still refused
    assert m.intake.next_version() is None
    m.intake.offer(version(3))
    assert next_number(m.intake) == 3
    m.intake.refuse(1)  # the mark only rises
    assert next_number(m.intake) == 3


def test_offers_from_many_threads_keep_the_newest():
    m = Machine(version(1))
    threads = [threading.Thread(target=m.intake.offer, args=(version(v),)) for v in range(2, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert next_number(m.intake) == 39


# -- a survivor placement computed on this rank (offer(..., supersede=True)) -------------------


def test_a_local_survivor_plan_supersedes_a_newer_offer_that_counts_the_dead_rank():
    base = version(1)
    m = Machine(base)
    m.intake.offer(version(5))  # a normal plan from before the death: rank 1 still up in it
    local = survivor(base)
    m.intake.offer(local, supersede=True)
    assert m.intake.next_version() is local and m.intake.local_survivor is local
    assert m.intake.is_local(local) and not m.intake.is_local(version(2, seed=100))
    assert resolve(m.intake) is None  # the dropped version is not resolved against it either


def test_a_local_survivor_plan_forgets_an_earlier_refusal_of_its_number():
    base = version(1)
    m = Machine(base)
    m.intake.offer(version(2))
    m.intake.refuse(2)  # the service's version 2 failed here (say, a rank died during it)
    local = survivor(base)
    m.intake.offer(local, supersede=True)
    assert m.intake.next_version() is local


def test_a_supersede_no_newer_than_current_is_an_ordinary_offer():
    m = Machine(version(3))
    m.intake.offer(survivor(version(1)), supersede=True)  # version 2: older than current
    assert m.intake.next_version() is None and m.intake.local_survivor is None


def test_service_versions_wait_while_a_local_plan_is_offered_and_the_newest_is_kept():
    base, m, local = offered_local()
    m.intake.offer(version(1))  # no newer than the base: dropped
    assert resolve(m.intake) is None
    m.intake.offer(version(3))
    m.intake.offer(version(2, seed=9))  # older than the one waiting: dropped
    assert m.intake.next_version() is local  # waiting does not change what is rolled out next
    resolution = resolve(m.intake)
    assert resolution == Resolution(Resolve.OFFER, resolution.version, base) and resolution.version.version == 3


@pytest.mark.parametrize("same", [True, False])
def test_a_service_version_takes_the_place_of_a_local_plan_still_only_offered(same):
    base, m, local = offered_local()
    service = survivor(base, seed=100 if same else 200)  # the service's plan of the pair, or another map
    m.intake.offer(service)
    resolution = resolve(m.intake)
    assert resolution == Resolution(Resolve.OFFER, service, base)
    assert m.intake.next_version() is service and m.intake.local_survivor is None
    assert resolve(m.intake) is None  # resolved once


def test_the_services_plan_of_the_pair_is_adopted_once_the_local_plan_is_routed():
    base, m, local = offered_local()
    m.current = local  # the machine switched to it
    m.intake.switched(local)
    assert m.intake.local_survivor is local  # still this rank's own number
    service = dataclasses.replace(local)  # the service's: same number, pair and map; another object
    m.intake.offer(service)
    assert resolve(m.intake) == Resolution(Resolve.ADOPT, service, base)
    assert m.intake.next_version() is service and m.intake.local_survivor is None


def test_another_plan_under_the_local_number_rebases_a_routed_local_plan():
    base, m, local = offered_local()
    m.current = local
    normal = version(2, seed=300)  # a normal plan the service numbered base + 1 too
    m.intake.offer(normal)
    assert resolve(m.intake) == Resolution(Resolve.REBASE, normal, base)
    m.current = base  # what the machine does with a REBASE
    assert m.intake.next_version() is normal  # newer than the base: rolled out from the local map


def test_an_offer_waits_while_the_machine_applies_a_rebase():
    # offer() reads current under the intake's lock: it must not see the local plan forgotten
    # while its number is still current, so the machine rebases inside resolving().
    base, m, local = offered_local()
    m.current = local
    normal = version(2, seed=300)
    m.intake.offer(normal)
    with m.intake.resolving() as resolution:
        assert resolution is not None and resolution.kind is Resolve.REBASE
        offering = threading.Thread(target=m.intake.offer, args=(version(3),))
        offering.start()
        offering.join(0.05)
        assert offering.is_alive()  # held until the rebase is in place
        m.current = resolution.base
    offering.join(5)
    assert next_number(m.intake) == 3


def test_a_switched_service_version_replaces_the_local_plan():
    base = version(1)
    m = Machine(base)
    m.intake.offer(survivor(base), supersede=True)
    m.intake.switched(version(2, seed=100))  # a service version, even with the same number and map
    assert m.intake.local_survivor is None
    m.intake.offer(version(3))  # offers are ordinary again
    assert next_number(m.intake) == 3 and resolve(m.intake) is None


# -- the service's survivor plan came first (a faster peer's SetRanksDown) --------------------


def test_a_services_survivor_plan_offered_before_the_local_one_is_kept_for_resolution():
    base = version(1)
    m = Machine(base)
    service = survivor(version(2), seed=400)  # planned from a version in flight: version 3, survivor of 2
    m.intake.offer(service)
    local = survivor(base)  # version 2, survivor of 1
    m.intake.offer(local, supersede=True)
    assert m.intake.next_version() is local
    assert resolve(m.intake) == Resolution(Resolve.OFFER, service, base)
    assert m.intake.next_version() is service


def test_an_earlier_offer_with_fewer_down_ranks_is_dropped_by_a_local_plan():
    base = version(1)
    m = Machine(base)
    m.intake.offer(survivor(base, seed=500, down=(0,)))  # another down set: not this death's plan
    m.intake.offer(survivor(base, down=(0, 1)), supersede=True)
    assert resolve(m.intake) is None


# -- a survivor placement whose weights moved outside the rollout (take_routed) ----------------


def test_take_routed_leaves_nothing_to_roll_out_and_drops_an_older_offer():
    base = version(1)
    m = Machine(base)
    m.intake.offer(version(2, seed=600, down=()))  # planned before the death: it counts rank 1
    local = survivor(base, down=(1,))
    m.intake.take_routed(local, base)
    m.current = local  # route_moved's half
    assert m.intake.next_version() is None and m.intake.local_survivor is local
    assert resolve(m.intake) is None  # so it was dropped, not kept for resolution


@pytest.mark.parametrize("service_first", [False, True])
def test_take_routed_adopts_the_services_plan_of_the_pair_whether_it_came_before_or_after(service_first):
    base = version(1)
    m = Machine(base)
    local = survivor(base, down=())
    service = dataclasses.replace(local)
    if service_first:
        m.intake.offer(service)
    m.intake.take_routed(local, base)
    m.current = local
    if not service_first:
        m.intake.offer(service)
    assert resolve(m.intake) == Resolution(Resolve.ADOPT, service, base)


def test_take_routed_forgets_an_earlier_refusal_of_its_number():
    base = version(1)
    m = Machine(base)
    m.intake.offer(version(2))
    m.intake.refuse(2)
    local = survivor(base)
    m.intake.take_routed(local, base)
    m.current = local
    normal = version(2, seed=700)
    m.intake.offer(normal)
    assert resolve(m.intake) == Resolution(Resolve.REBASE, normal, base)
    m.current = base
    assert m.intake.next_version() is normal  # version 2 is not refused any more


def test_a_resolution_is_a_frozen_record():
    resolution = Resolution(Resolve.OFFER, version(2), version(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolution.kind = Resolve.ADOPT  # type: ignore[misc]

"""The policy registry: options checked once, re-plans applied by rebalance for replans=True."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

import eplb


@dataclass(frozen=True)
class _Opts:
    offset: int = 0

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"offset must be >= 0, got {self.offset}")


def _round_robin(loads: np.ndarray, topology: eplb.Topology, options: _Opts) -> eplb.PolicyResult:
    slots = (np.arange(topology.num_slots) + options.offset) % topology.num_experts
    return eplb.PolicyResult(np.tile(slots, (topology.num_layers, 1)).astype(np.int32), "round-robin")


@pytest.fixture
def registered() -> Iterator[None]:
    eplb.register_policy("test-rr", options=_Opts, replans=True)(_round_robin)
    eplb.register_policy("test-rr-fresh", options=_Opts)(_round_robin)
    yield
    eplb.unregister_policy("test-rr")
    eplb.unregister_policy("test-rr-fresh")


TOPO = eplb.Topology(3, 8, 12, 4)


def test_a_registered_policy_gets_its_checked_options(registered: None) -> None:
    loads = np.random.default_rng(0).random((3, 8))
    plan = eplb.rebalance(loads, TOPO, "test-rr", offset=2)
    assert plan.phy2log[0, 0] == 2 and plan.policy_used == "round-robin"
    with pytest.raises(ValueError, match="offset must be >= 0"):
        eplb.rebalance(loads, TOPO, "test-rr", offset=-1)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['seed'\]; allowed: offset, tolerance"):
        eplb.rebalance(loads, TOPO, "test-rr", seed=1)
    # Options of a policy without re-plans do not include the re-plan's.
    assert eplb.get_policy("test-rr-fresh").option_names() == ("offset",)
    with pytest.raises(ValueError, match="unknown option"):
        eplb.rebalance(loads, TOPO, "test-rr-fresh", tolerance=0.1)


def test_rebalance_makes_replans_migration_aware_only_where_registered(registered: None) -> None:
    loads = np.random.default_rng(1).random((3, 8))
    previous = eplb.rebalance(loads, TOPO, "global").placement
    aware = eplb.rebalance(loads, TOPO, "test-rr", previous=previous, offset=1)
    fresh = eplb.rebalance(loads, TOPO, "test-rr-fresh", previous=previous, offset=1)
    assert aware.replan is not None and sum(aware.replan.layers().values()) == TOPO.num_layers
    assert fresh.replan is None
    # The round-robin plan is worse than the global one: a re-plan keeps layers where it can.
    assert aware.total_moves < fresh.total_moves
    # Bad re-plan options fail whether or not previous= is given.
    with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
        eplb.rebalance(loads, TOPO, "test-rr", tolerance=-1)


def test_registry_refuses_duplicates_and_non_dataclass_options(registered: None) -> None:
    with pytest.raises(ValueError, match="already registered"):
        eplb.register_policy("test-rr")(_round_robin)
    with pytest.raises(ValueError, match="dataclass type"):
        eplb.register_policy("test-bad", options=dict)
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        eplb.unregister_policy("nope")


def test_builtin_specs() -> None:
    assert {p for p in eplb.policies() if eplb.get_policy(p).replans} == {"auto", "global", "hierarchical"}
    assert "effort" in eplb.get_policy("auto").option_names()
    assert eplb.get_policy("deepseek").option_names() == ()
    assert "time_limit" in eplb.get_policy("ilp").option_names()
    with pytest.raises(ValueError, match="takes no options"):
        eplb.rebalance(np.ones((3, 8)), TOPO, "deepseek", effort="fast")
    assert eplb.PlanOptions().work_per_layer > 0 and eplb.Migration().tolerance == 0.01


@dataclass(frozen=True)
class _Clash:
    tolerance: float = 0.5


@dataclass
class _Mutable:
    offset: int = 0


@dataclass(frozen=True)
class _NoDefault:
    offset: int


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        (3, {}, "policy name must match"),
        ("", {}, "policy name must match"),
        ("Has Space", {}, "policy name must match"),
        (
            "test-clash",
            {"options": _Clash, "replans": True},
            r"may not reuse the re-plan's option names \['tolerance'\]",
        ),
        ("test-mutable", {"options": _Mutable}, "must be a frozen dataclass"),
        ("test-nodefault", {"options": _NoDefault}, r"every field needs a default.*\['offset'\]"),
    ],
)
def test_registration_refuses_what_would_break_later(name: object, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        eplb.register_policy(name, **kwargs)  # type: ignore[arg-type]
    assert name not in eplb.policies()


def test_a_policy_returning_something_else_is_named_in_the_error() -> None:
    eplb.register_policy("test-bare")(lambda loads, topology, options: np.zeros((3, 12), dtype=np.int32))
    eplb.register_policy("test-short")(lambda loads, topology, options: eplb.PolicyResult(np.zeros((3, 5)), "x"))
    try:
        with pytest.raises(eplb.PolicyError, match="policy 'test-bare' returned ndarray, not a PolicyResult"):
            eplb.rebalance(np.ones((3, 8)), TOPO, "test-bare")
        with pytest.raises(eplb.PolicyError, match="policy 'test-short' returned an invalid placement"):
            eplb.rebalance(np.ones((3, 8)), TOPO, "test-short")
    finally:
        eplb.unregister_policy("test-bare")
        eplb.unregister_policy("test-short")


def test_a_policy_without_replans_says_so_when_given_previous() -> None:
    loads = np.random.default_rng(2).random((3, 8)) * 100
    previous = eplb.rebalance(loads, TOPO, "global").placement
    plan = eplb.rebalance(loads, TOPO, "deepseek", previous=previous)
    assert plan.replan is None and any("plans from scratch" in n for n in plan.notes)

"""The library's memory guard: a plan whose estimated memory (``eplb.limits.plan_bytes``) is
above the limit (``eplb.limits.max_plan_bytes()``) is refused before it allocates, in every
planning entry point; the limit can be raised; the estimate is above what real plans use."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc

import pytest

import eplb
from eplb import limits
from eplb.compat.deepseek import rebalance_experts
from eplb.planner.anytime import PlanOptions, flat_topology, place_global, plan_placement
from eplb.replan.choose import choose
from eplb.replan.migration import Migration
from eplb.survivors import live_topology
from eplb.workloads import make_loads


@pytest.fixture(autouse=True)
def _default_limit():
    """Each test starts at the default limit and leaves it as it found it."""
    old = eplb.set_max_plan_bytes(None)
    yield
    eplb.set_max_plan_bytes(old)


def test_the_issue_plan_is_refused_at_once_naming_the_estimate_and_the_limit():
    # It grew to 23 GB in two minutes and was killed by the kernel. Run in a process whose
    # address space is capped, so that a guard that does not hold fails here (MemoryError)
    # instead of taking the machine's memory.
    code = textwrap.dedent(
        """
        import resource, time
        import numpy as np
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import eplb
        loads = np.broadcast_to(np.float32(1), (1, 10**8))  # the issue's np.ones, without its 400 MB
        topo = eplb.Topology(num_layers=1, num_experts=10**8, num_slots=10**8, num_gpus=1)
        start = time.perf_counter()
        try:
            eplb.rebalance(loads, topo)
        except ValueError as exc:
            print(f"{time.perf_counter() - start:.3f}")
            print(exc)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    seconds, message = run.stdout.splitlines()
    assert float(seconds) < 1.0
    assert message == (
        "a plan of 1 layer x 100000000 experts on 100000000 slots (100000000 per gpu) needs about 50 PB of memory "
        "(eplb.limits.plan_bytes), more than the limit of 8.59 GB (eplb.limits.max_plan_bytes()); on a machine "
        "with the memory, raise it with eplb.set_max_plan_bytes(n); or plan fewer layers, experts or slots per gpu"
    )


TOPO = eplb.Topology(2, 16, 32, 4, 2, 4)


def _calls() -> dict:
    """Every public planning entry point on ``TOPO``: (topology the guard checks, replan, call)."""
    loads = make_loads("zipf-1.0", TOPO, seed=1)
    previous = eplb.Placement.contiguous(TOPO)
    fresh = place_global(loads, TOPO)
    live = live_topology(TOPO, [0])
    return {
        "rebalance": (TOPO, False, lambda: eplb.rebalance(loads, TOPO)),
        "rebalance previous=": (TOPO, True, lambda: eplb.rebalance(loads, TOPO, previous=previous)),
        "rebalance down_gpus=": (live, False, lambda: eplb.rebalance(loads, TOPO, down_gpus=[0])),
        "rebalance previous= down_gpus=": (
            live,
            True,
            lambda: eplb.rebalance(loads, TOPO, previous=previous, down_gpus=[0]),
        ),
        "rebalance policy=deepseek": (TOPO, False, lambda: eplb.rebalance(loads, TOPO, "deepseek")),
        "plan_placement": (TOPO, False, lambda: plan_placement(loads, TOPO, PlanOptions())),
        "place_global": (flat_topology(TOPO), False, lambda: place_global(loads, TOPO)),
        "choose": (TOPO, True, lambda: choose(loads, previous, fresh, TOPO, Migration(), False)),
        "compat rebalance_experts": (TOPO, False, lambda: rebalance_experts(loads, 32, 4, 2, 4)),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_every_planning_entry_point_refuses_a_plan_above_the_limit_and_plans_at_it(name):
    topo, replan, call = _calls()[name]
    need = limits.plan_bytes(topo, replan=replan)
    eplb.set_max_plan_bytes(need - 1)
    with pytest.raises(ValueError, match=r"needs about .* of memory \(eplb.limits.plan_bytes\), more than the limit"):
        call()
    eplb.set_max_plan_bytes(need)  # raised to the estimate: the same call plans
    call()


def test_the_message_names_the_estimate_and_the_limit_of_a_re_plan():
    topo = eplb.Topology(58, 256, 4096, 8)
    need = limits.plan_bytes(topo, replan=True)
    assert need > limits.MAX_PLAN_BYTES > limits.plan_bytes(topo)  # only the re-plan's repairs are too large
    with pytest.raises(ValueError) as err:
        limits.check_plan_bytes(topo, replan=True)
    assert str(err.value).startswith(
        f"a re-plan of 58 layers x 256 experts on 4096 slots (512 per gpu) needs about {limits.size_text(need)} of "
        "memory (eplb.limits.plan_bytes), more than the limit of 8.59 GB (eplb.limits.max_plan_bytes())"
    )
    assert eplb.set_max_plan_bytes(need) == limits.MAX_PLAN_BYTES
    limits.check_plan_bytes(topo, replan=True)
    assert limits.max_plan_bytes() == need


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8G"])
def test_the_limit_is_a_positive_number_of_bytes(bad):
    with pytest.raises(ValueError, match="positive integer number of bytes or None"):
        eplb.set_max_plan_bytes(bad)
    assert limits.max_plan_bytes() == limits.MAX_PLAN_BYTES


def _peak(call) -> int:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        call()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


# Two slots per gpu (the search's pairings) for fresh plans; 128 slots per gpu (the repairs'
# swap grids) for re-plans: where the estimate before this change was 10 to 150 times low.
@pytest.mark.parametrize(
    ("shape", "replan", "down"),
    [
        ((4, 64, 128, 64), False, []),
        ((4, 64, 128, 64), False, [0]),
        ((2, 256, 512, 4), True, []),
        ((2, 256, 512, 4), True, [0]),
    ],
    ids=["fresh", "survivor", "re-plan", "survivor re-plan"],
)
def test_the_estimate_is_above_the_memory_a_plan_uses(shape, replan, down):
    topo = eplb.Topology(*shape)
    previous = eplb.rebalance(make_loads("zipf-1.0", topo, seed=0), topo, effort="fast").placement
    loads = make_loads("zipf-1.0", topo, seed=1)
    peak = _peak(lambda: eplb.rebalance(loads, topo, previous=previous if replan else None, down_gpus=down))
    assert limits.plan_bytes(live_topology(topo, down), replan=replan) >= peak

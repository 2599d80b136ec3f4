"""The balancer's collaborators (service/balancer.py), each built on the memory store without a
gRPC server; and the rules that keep them apart: no import circle among service/ modules, no
mixins, no collaborator reaching into another's private attributes."""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from svc_helpers import small_deployment

import eplb
from eplb_service import balancer
from eplb_service.compute import Compute
from eplb_service.config import BalancerConfig
from eplb_service.deployments import Deployments
from eplb_service.errors import InvalidArgument, NotFound, StoreUnavailable
from eplb_service.ingest import Ingest
from eplb_service.liveness import Liveness
from eplb_service.memory_store import MemoryStore
from eplb_service.metrics import Metrics
from eplb_service.planner import Planner
from eplb_service.registry import Registry
from eplb_service.solver import Solver
from eplb_service.store_health import StoreHealth
from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

SERVICE = Path(__file__).resolve().parents[2] / "service"
COLLABORATORS = (
    balancer.Balancer,
    StoreHealth,
    Registry,
    Ingest,
    Liveness,
    Planner,
    Compute,
    Deployments,
)
# Plans in a thread of this process: the collaborators alone, no worker processes.
IN_THREAD = Solver(workers=0, compute_workers=0, small_workers=0)
SKEWED = np.broadcast_to((np.arange(16, dtype=np.int32) % 7 + 1) * 10, (4, 16)).copy()


async def stored(store: MemoryStore, name: str = "d1", **fields: object) -> pb.Deployment:
    """``small_deployment(name)`` written to ``store`` at version 1 (contiguous), as CreateDeployment does."""
    deployment = small_deployment(name)
    for key, value in fields.items():
        getattr(deployment, key).CopyFrom(value)
    deployment.create_time.FromNanoseconds(time.time_ns())
    topo = eplb.Topology(4, 16, 24, 8, 2, 4)
    first = pb.Placement(
        deployment=name,
        version=1,
        phy2log=arrays.encode(eplb.Placement.contiguous(topo).phy2log),
        stats=pb.PlanStats(policy="initial", policy_used="initial"),
    )
    first.create_time.CopyFrom(deployment.create_time)
    await store.create(deployment, first)
    return deployment


def report(name: str, rank: int, seq: int, counts: np.ndarray = SKEWED) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(deployment=name, rank=rank, seq=seq, logical=arrays.encode(counts))


class Restartable:
    """A memory store that can restart empty (a new run id, nothing in it), like Redis without persistence."""

    def __init__(self) -> None:
        self.inner = MemoryStore()

    def restart(self) -> None:
        self.inner = MemoryStore()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def rooms(store: object, config: BalancerConfig | None = None) -> tuple[StoreHealth, Registry, Ingest, Planner]:
    config = config or BalancerConfig(replica_id="r1")
    health = StoreHealth(store)
    registry = Registry(store, Metrics(), health)
    ingest = Ingest(registry, store, health, registry.metrics, config.replica_id)
    planner = Planner(registry, ingest, IN_THREAD, store, health, registry.metrics, config)
    return health, registry, ingest, planner


# StoreHealth


async def test_store_health_reports_changes_once_and_refuses_writes_while_down():
    store = MemoryStore()
    changes: list[bool] = []
    per_deployment: list[tuple[str, bool]] = []
    health = StoreHealth(store, changes.append, lambda name, ok: per_deployment.append((name, ok)))
    await health.start()
    assert health.run_id == await store.ping() == await health.ping()
    assert not health.restarted(health.run_id) and health.restarted("another run")
    health.check_writable()  # healthy: no error
    health.set_health(False)
    health.set_health(False)
    with pytest.raises(StoreUnavailable, match="NOT_SERVING"):
        health.check_writable()
    health.set_health(True)
    assert changes == [False, True]
    health.set_down({"a"}, ["a", "b"])
    health.set_down({"a"}, ["a", "b"])  # unchanged: not reported again
    assert sorted(per_deployment) == [("a", False), ("b", True)]
    assert health.down == {"a"}


# Registry


async def test_registry_follows_forgets_and_confirms_deletions():
    store = MemoryStore()
    _, registry, _, _ = rooms(store)
    await stored(store, "d1")
    await registry.refresh()
    local = registry.local["d1"]
    assert local.topology.num_slots == 24 and local.ranks == frozenset(range(8))
    assert await registry.get("d1") is local
    with pytest.raises(NotFound):
        await registry.get("missing")
    newer = pb.Placement(deployment="d1", version=3, stats=pb.PlanStats(imbalance_after=1.25))
    registry.seen(newer)
    registry.seen(pb.Placement(deployment="d1", version=2))  # older: ignored
    assert registry.latest("d1") is newer
    assert registry.metrics.version.labels("d1")._value.get() == 3
    assert not await registry.confirm_deleted("d1")
    await store.delete("d1")
    assert await registry.confirm_deleted("d1")
    registry.forget("d1")
    assert "d1" not in registry.local and registry.latest("d1") is None


async def test_registry_writes_back_what_it_knows_after_the_store_restarted_empty():
    store = Restartable()
    health, registry, _, _ = rooms(store)
    await health.start()
    await stored(store, "d1")
    local = await registry.get("d1")
    registry.seen(await store.placement("d1"))
    store.restart()
    await registry.check_health()
    assert (await store.get("d1")).version == 1
    assert health.run_id == await store.ping() and health.healthy
    # A NOT_FOUND of a followed deployment checks for a restart first, then asks again.
    store.restart()
    assert (await registry.known("d1", lambda: store.get("d1"))).deployment.name == "d1"
    await local.hub.stop()


# Ingest and Liveness


async def test_ingest_dedups_windows_and_flushes_to_the_store():
    store = MemoryStore()
    health, registry, ingest, _ = rooms(store)
    await stored(store, "d1")
    assert await ingest.report(report("d1", rank=0, seq=1))
    assert not await ingest.report(report("d1", rank=0, seq=1))  # duplicate (rank, seq)
    assert await ingest.report(report("d1", rank=1, seq=1))
    local = registry.local["d1"]
    loads, reports = local.window.total(time.time())
    assert reports == 2 and np.array_equal(loads, 2 * SKEWED)
    await ingest.flush_all()
    assert not local.dirty and "r1" in await store.windows("d1")
    with pytest.raises(InvalidArgument, match="rank"):
        await ingest.report(report("d1", rank=99, seq=2))
    health.set_health(False)
    with pytest.raises(StoreUnavailable):
        await ingest.report(report("d1", rank=0, seq=2))


async def test_liveness_writes_the_times_seen_and_counts_no_suspect_early():
    store = MemoryStore()
    _, registry, ingest, _ = rooms(store)
    await stored(store, "d1", liveness=pb.Liveness(suspect_after=Duration(seconds=60)))
    liveness = Liveness(registry, store, registry.metrics, liveness_s=1.0)
    assert await ingest.report(report("d1", rank=3, seq=1))
    local = registry.local["d1"]
    assert set(local.seen_unwritten) == {3}
    await liveness.run()
    assert set((await store.seen("d1")).ranks) == {3} and not local.seen_unwritten
    assert await liveness.suspects(local.deployment, set(), local) == []
    assert registry.metrics.suspect_ranks.labels("d1")._value.get() == 0


# Planner, Compute, Deployments


async def test_planner_rebalances_and_triggers_on_its_own():
    store = MemoryStore()
    _, registry, ingest, planner = rooms(store)
    await stored(store, "forced")
    await stored(store, "triggered", trigger=pb.Trigger(report_count=1))
    assert await ingest.report(report("forced", rank=0, seq=1))
    answer = await planner.rebalance(pb.RebalanceRequest(deployment="forced", force=True))
    assert answer.published and answer.placement.version == 2
    assert registry.latest("forced").version == 2 and answer.window_reports == 1
    assert await ingest.report(report("triggered", rank=0, seq=1))
    await registry.refresh()
    await planner.trigger_all()
    await planner.trigger_all()  # while the first runs: no second re-plan of the same deployment
    deadline = time.monotonic() + 10
    while (await store.placement("triggered")).version < 2:
        assert time.monotonic() < deadline, "the triggered re-plan never published"
        await asyncio.sleep(0.02)
    await planner.stop()
    plans = registry.metrics.rebalances.labels("triggered", "auto", "published")._value.get()
    skipped = registry.metrics.rebalances.labels("triggered", "auto", "skipped")._value.get()
    assert (plans, skipped) == (1, 0)


async def test_compute_plans_statelessly_and_names_bad_input():
    compute = Compute(IN_THREAD)
    topology = pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)
    answer = await compute.placement(
        pb.ComputePlacementRequest(topology=topology, policy="auto", loads=arrays.encode(SKEWED)), None
    )
    phy2log = arrays.decode(answer.phy2log, "phy2log", (4, 24))
    assert sorted(set(phy2log.ravel().tolist())) == list(range(16))  # every expert placed
    with pytest.raises(InvalidArgument, match="loads"):
        await compute.placement(
            pb.ComputePlacementRequest(topology=topology, policy="auto", loads=arrays.encode(SKEWED[:2])), None
        )


async def test_deployments_create_ack_get_and_delete():
    store = MemoryStore()
    config = BalancerConfig(replica_id="r1")
    health, registry, ingest, planner = rooms(store, config)
    liveness = Liveness(registry, store, registry.metrics, config.liveness_s)
    deployments = Deployments(registry, store, health, liveness, planner, registry.metrics, config)
    created = await deployments.create(pb.CreateDeploymentRequest(deployment=small_deployment("d1")))
    assert created.placement.version == 1 and "d1" in registry.local
    for rank in range(8):
        await deployments.ack(
            pb.AckPlacementRequest(deployment="d1", rank=rank, version=1, state=pb.ACK_STATE_SWITCHED)
        )
    got = await deployments.get("d1")
    assert got.status.ranks_acked == 8 and got.status.num_ranks == 8
    assert [d.name for d in (await deployments.list()).deployments] == ["d1"]
    assert (await deployments.placement("d1")).version == 1
    await deployments.delete("d1")
    assert "d1" not in registry.local
    with pytest.raises(NotFound):
        await deployments.get("d1")


# The rules that keep the rooms apart


def relative_imports(path: Path) -> set[str]:
    """The service/ modules ``path`` imports, anywhere in it (under TYPE_CHECKING and in functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eplb_service."):
            out.add(node.module.split(".")[1])
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (found := visit(mod)) is not None:
            return found
    return None


def test_the_service_modules_import_each_other_one_way():
    modules = {p.stem: p for p in SERVICE.glob("*.py")}
    graph = {name: relative_imports(path) & modules.keys() for name, path in modules.items()}
    # The scan sees imports: the status map stands alone; its interceptor applies it and hands the
    # other jobs to collaborators of one job each, the call hook counting into metrics.
    assert graph["deployments"] and graph["errors"] == {"clip"}
    assert graph["calls"] == {"decoding", "draining", "errors"}
    assert graph["call_metrics"] == {"calls", "metrics"}
    assert graph["audit"] == {"calls", "clip", "decoding", "log_throttle"}
    assert graph["draining"] == {"decoding", "errors"} and graph["log_throttle"] == set()
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # and finds one where there is


def test_collaborators_are_separate_classes_that_keep_out_of_each_others_privates():
    for cls in COLLABORATORS:
        assert cls.__bases__ == (object,), f"{cls.__name__} inherits {cls.__bases__}: a mixin"
    # Private names each collaborator defines (methods, and attributes it assigns on self).
    private: dict[str, str] = {}
    trees = {p: ast.parse(p.read_text()) for p in SERVICE.glob("*.py")}
    names = {cls.__name__ for cls in COLLABORATORS}
    for tree in trees.values():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in names):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                    private.setdefault(node.name, cls.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    if node.attr.startswith("_") and isinstance(node.ctx, ast.Store):
                        private.setdefault(node.attr, cls.name)
    private = {k: v for k, v in private.items() if not k.startswith("__")}
    assert {"_trigger", "_latest"} <= private.keys()  # the scan sees them
    reaching = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            # ``<anything but self>._x`` or ``self.<other>._x``, where ``_x`` is a collaborator's own.
            if isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    reaching.append(f"{path.name}:{node.lineno} {ast.unparse(node)} ({private[node.attr]}'s)")
    assert reaching == []

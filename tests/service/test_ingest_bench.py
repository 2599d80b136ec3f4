"""ingest_bench's pinning and per-shard figures: core lists, affinity inherited by what the bench
starts, and a real (short) run against a private redis-server and one ``eplb serve`` instance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from eplb_bench import ingest_bench
from eplb_bench.harness import cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_cpu_list_reads_cores_and_ranges():
    assert cores.cpu_list("0,2-4") == [0, 2, 3, 4]
    assert cores.cpu_list("3") == [3]


def test_cpu_list_names_the_bad_part():
    with pytest.raises(ValueError, match=r"'x' is not a core number"):
        cores.cpu_list("0,x")


def test_pin_is_inherited_by_started_processes():
    core = min(os.sched_getaffinity(0))
    try:
        cores.pin([core])
        out = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == f"[{core}]"
    finally:
        cores.pin(None)
    assert sorted(os.sched_getaffinity(0)) == cores._ALL_CORES


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_short_run_reports_per_shard_figures(tmp_path):
    core = min(os.sched_getaffinity(0))
    path = tmp_path / "rows.json"
    argv = ["--kinds", "redis", "--instances", "1", "--deployments", "1", "--seconds", "0.5", "--rate", "100"]
    argv += ["--cpus-service", str(core), "--json", str(path)]
    assert ingest_bench.main(argv) == 0
    (row,) = json.loads(path.read_text())
    assert row["max_reports_per_s"] > 0
    # Redis and the instance both did work for the accepted reports, and it was measured.
    assert row["redis_ms_per_report"] > 0
    assert row["service_ms_per_report"] > 0
    assert 0 < row["service_cores"] <= 1.05  # pinned to one core


@pytest.mark.parametrize("kind", ["bare", "memory"])
def test_the_bare_and_memory_kinds_measure_without_redis(tmp_path, kind):
    path = tmp_path / "rows.json"
    argv = ["--kinds", kind, "--instances", "1", "--deployments", "1", "--seconds", "0.5", "--rate", "100"]
    assert ingest_bench.main([*argv, "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    assert row["redis"] == kind
    # The server (bare, or eplb serve on its embedded store) received the reports and
    # answered GetPlacement; no Redis was involved.
    assert row["max_reports_per_s"] > 0 and row["paced_reports_per_s"] > 0
    assert row["paced_get_p99_ms"] > 0
    assert row["bytes_per_report"] == 0 and row["redis_ms_per_report"] == 0
    assert row["service_ms_per_report"] > 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_reader_replica_protobuf_clients_and_the_clients_cpu(tmp_path):
    # --probe-on reader: GetPlacement goes to one more instance that takes no reports (it
    # shares the store); the clients' own CPU over the load (not their start-up) is measured.
    path = tmp_path / "rows.json"
    argv = ["--kinds", "redis", "--instances", "1", "--deployments", "1", "--seconds", "0.5", "--rate", "100"]
    argv += ["--probe-on", "reader", "--clients", "protobuf", "--probe-callers", "1", "--json", str(path)]
    assert ingest_bench.main(argv) == 0
    (row,) = json.loads(path.read_text())
    assert row["probe_on"] == "reader"
    assert row["max_reports_per_s"] > 0 and row["paced_get_p99_ms"] > 0
    # Two client processes and a caller, each under a core: more than nothing, less than all.
    assert 0 < row["paced_client_cores"] < 3.05


def test_a_reader_replica_needs_a_shared_store(capsys):
    with pytest.raises(SystemExit):
        ingest_bench.main(["--kinds", "memory", "--probe-on", "reader"])
    assert "--probe-on reader needs instances that share a store" in capsys.readouterr().err


def test_streams_set_the_load_clients_ranks(tmp_path):
    # --streams: each load client process opens this many ReportLoad streams, one rank each
    # (the deployments are created with that many ranks, or the reports would be refused).
    path = tmp_path / "rows.json"
    argv = ["--kinds", "memory", "--instances", "1", "--deployments", "2", "--seconds", "0.5", "--rate", "100"]
    assert ingest_bench.main([*argv, "--streams", "11", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    assert row["streams"] == 11
    assert row["max_reports_per_s"] > 0 and row["paced_reports_per_s"] > 0


def test_streams_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        ingest_bench.main(["--kinds", "memory", "--streams", "0"])
    assert "--streams must be at least 1, got 0" in capsys.readouterr().err

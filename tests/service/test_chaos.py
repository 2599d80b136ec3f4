"""A short chaos run (``bench/chaos_bench.py`` runs the long one): 16 ranks and 50 watchers over
2 instances and a private Redis (AOF, ``appendfsync always``), instances SIGKILLed and SIGTERMed
and Redis SIGKILLed at random moments for 20 s, each restarted after a random pause."""

from __future__ import annotations

import shutil

import pytest

from eplb_bench.chaos_bench import ChaosConfig, run_chaos, traceback_excerpts


@pytest.mark.slow
def test_chaos_loses_no_report_and_skips_no_version(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    result = run_chaos(ChaosConfig(seconds=20, instances=2, ranks=16, watchers=50, lease_s=5.0, seed=11))
    # Each kind of failure happened, under load, and the service kept publishing through them.
    assert set(result.events) == {"sigkill_instance", "sigterm_instance", "sigkill_redis"}
    assert result.reports_sent > 1000 and sum(result.report_retries.values()) > 0
    assert result.versions > 5 and sum(result.watcher_reconnects.values()) > 0
    # Exactly once, consecutive, SERVING within a lease (the harness's checks, with figures).
    assert result.failures == []
    assert result.window_reports == result.reports_sent and result.resent_accepted == 0
    assert result.watcher_gaps == result.watcher_duplicates == result.watchers_behind == 0
    assert result.serving_s and max(s for _, s in result.serving_s) <= result.config.lease_s
    assert result.tracebacks_in_logs == 0, "\n\n".join(result.tracebacks)


@pytest.mark.slow
def test_chaos_on_a_redis_cluster_loses_no_report_when_a_master_is_killed(tmp_path):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not on PATH")
    config = ChaosConfig(seconds=20, instances=2, ranks=16, watchers=50, lease_s=5.0, seed=12, cluster=True)
    result = run_chaos(config)
    # The deployment's master was SIGKILLed and restarted (AOF), instances too, under load.
    assert set(result.events) == {"sigkill_instance", "sigterm_instance", "sigkill_redis"}
    assert result.reports_sent > 1000 and result.versions > 5
    assert result.failures == []
    assert result.window_reports == result.reports_sent and result.resent_accepted == 0
    assert result.watcher_gaps == result.watcher_duplicates == result.watchers_behind == 0
    assert result.tracebacks_in_logs == 0, "\n\n".join(result.tracebacks)


def test_a_traceback_in_a_replica_log_is_quoted_with_its_exception():
    log = "\n".join(
        [
            "12:00:01 INFO eplb_service.trigger: re-plan of d1",
            "12:00:02 ERROR eplb_service.trigger: re-plan of d1 failed",
            "Traceback (most recent call last):",
            '  File "trigger.py", line 10, in run',
            "    plan()",
            "ValueError: loads must be finite",
            "12:00:03 INFO eplb_service.trigger: next",
        ]
    )
    (excerpt,) = traceback_excerpts(log)
    assert excerpt.splitlines()[0].endswith("re-plan of d1 failed")
    assert excerpt.splitlines()[-1] == "ValueError: loads must be finite"
    assert "next" not in excerpt

"""``eplb demo --fail-rank R --fail-at STEP``: a rank's process killed mid-run, the survivors
detecting it, switching to the survivor placement and routing on, every dispatch checked."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import eplb
from eplb_tools import cli
from eplb_tools.demo import DemoConfig, _summary
from eplb_tools.demo_failure import lost_experts


def _demo(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "eplb_tools.cli", "demo", "--ranks", "3", "--seconds", "4", "--json", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _assert_the_report_reads_in_order(proc: subprocess.CompletedProcess) -> None:
    """No service log line in the report; a version's switch line comes before "vN adopted", and
    a survivor placement's line says so instead of "imbalance 0.000 -> ..."."""
    assert "audit:" not in proc.stdout + proc.stderr, proc.stderr
    assert "imbalance 0.000 ->" not in proc.stdout, proc.stdout
    lines = proc.stdout.splitlines()
    for i, line in enumerate(lines):
        if " adopted: " in line:
            version = line.split()[0]
            later = [x for x in lines[i + 1 :] if x.split()[:1] == [version] and " adopted: " not in x]
            assert not later, (line, later)


@pytest.mark.slow
# Killed at step 20, before the first re-plan (about step 50): no prepare is in flight, which
# ranks_down would wait for (up to the mover groups' 10 s timeout).
@pytest.mark.parametrize(("barrier", "dead", "at"), [("group", 1, 20), ("service", 0, 20)])
def test_a_killed_rank_is_routed_around_and_every_dispatch_still_checked(tmp_path, barrier, dead, at):
    # Rank 0 too: the gloo store is the parent's, not rank 0's.
    proc, s = _demo(tmp_path, "--barrier", barrier, "--fail-rank", str(dead), "--fail-at", str(at))
    assert s["misrouted_dispatches"] == 0 and s["checksum_mismatches"] == 0
    _assert_the_report_reads_in_order(proc)
    (f,) = s["failures"]
    assert (f["rank"], f["step"]) == (dead, at)
    # Switched a few steps after the kill, every survivor at the same step.
    assert at < f["recovered_step"] < 200 and f["recovered_steps_agree"], proc.stdout + proc.stderr[-3000:]
    assert 0 < f["detect_s"] < f["recovery_s"] < 30
    # Every (layer, expert) whose replicas were all on the dead rank came back through the loader.
    # On the contiguous map rank 1 alone holds experts 16..31 of each layer; rank 2 repeats
    # 0..15, so rank 0's death loses none.
    assert f["experts_reloaded"] >= f["experts_lost"] == f["experts_lost_at_switch"] == {0: 0, 1: 6 * 16}[dead]
    # Tokens sent to the dead rank before the switch are lost (counted apart), none after it.
    assert f["dispatches_lost"] > 0 and f["dispatches_to_dead_after_recovery"] == 0
    # The dead rank routed until it died; the two survivors all 200; every dispatch checked or lost.
    assert s["tokens_routed"] == (2 * 200 + at) * 1024
    assert s["dispatches_checked"] + f["dispatches_lost"] == s["tokens_routed"] * 4 * 6
    # The service heard of it and has the survivors on one version, the dead rank behind.
    assert s["service_down_ranks"] == [dead]
    acked = s["service_acked_versions"]
    live = [r for r in range(3) if r != dead]
    assert acked[live[0]] == acked[live[1]] >= f["survivor_version"] > acked[dead]
    assert f"rank {dead} killed at step {at} (SIGKILL)" in proc.stdout
    assert f"rank {dead} killed at step {at}: switched to the survivor placement" in proc.stdout


@pytest.mark.slow
# 300 steps. The first switch comes about step 45 with the group barrier, about step 85 with
# the service's (half a second from the last PREPARED ack to the switch), later under load
# (step 85 with the group barrier at load average 4): the kills leave a margin.
@pytest.mark.parametrize(("barrier", "at"), [("group", 130), ("service", 180)])
def test_a_rank_killed_after_the_first_replan_is_still_routed_around(tmp_path, barrier, at):
    """Killed after the first re-plan switched (group barrier: about step 45): the survivor
    placement comes from that version, and the service's survivor plan from whatever it has
    published. A survivor whose watcher brought the service's plan before its own ranks_down
    ran dropped it, and the survivors never agreed a start: recovered_step -1 (the engine's
    side: tests/engine/test_survivor_plan_before_ranks_down.py)."""
    flags = ("--seconds", "6", "--barrier", barrier, "--fail-rank", "1", "--fail-at", str(at))
    proc, s = _demo(tmp_path, *flags)  # the last --seconds wins
    log = proc.stdout + proc.stderr[-3000:]
    assert s["misrouted_dispatches"] == 0 and s["checksum_mismatches"] == 0
    switched = [e["step"] for e in s["replans"]]
    assert switched and min(switched) < at, log  # a re-plan was routed before the kill
    (f,) = s["failures"]
    assert at < f["recovered_step"] < 300 and f["recovered_steps_agree"], log
    assert f["experts_reloaded"] > 0 and f["dispatches_to_dead_after_recovery"] == 0
    if barrier == "group":  # the local plan restores every pair lost from the version routed at the death
        assert f["experts_reloaded"] >= f["experts_lost"], log
    # With the service barrier a version whose switch step was fixed before the death still
    # switches after it, and may copy some lost pairs to the survivors (seen: 80 of 96 then
    # reloaded): every pair lost in the map the survivor move started from is reloaded.
    assert f["experts_reloaded"] >= f["experts_lost_at_switch"], log
    acked = s["service_acked_versions"]
    assert acked[0] == acked[2] >= f["survivor_version"] > acked[1]
    assert f"rank 1 killed at step {at}: switched to the survivor placement" in proc.stdout
    _assert_the_report_reads_in_order(proc)


@pytest.mark.slow
# Killed at step 20 (before the first re-plan), restarted at step 40 of 400: it is up 1.4 s later
# on an idle 2-core machine (importing torch), 5.2 s later at load average 9 (the join at step
# 283 of a run from step 60), so it joins with a margin either way.
@pytest.mark.parametrize("barrier", ["group", "service"])
def test_a_restarted_rank_loads_its_weights_and_serves_again(tmp_path, barrier):
    flags = ("--seconds", "8", "--barrier", barrier, "--fail-rank", "1", "--fail-at", "20", "--rejoin-at", "40")
    proc, s = _demo(tmp_path, *flags)
    log = proc.stdout + proc.stderr[-3000:]
    # Every dispatch checked, before the death, between it and the rejoin, and after it.
    assert s["misrouted_dispatches"] == 0 and s["checksum_mismatches"] == 0, log
    (f,) = s["failures"]
    assert 20 < f["recovered_step"] < f["rejoined_step"] < 400 and 40 < f["rejoined_step"], log
    assert f["rejoined_steps_agree"], log
    assert 0 < f["rejoin_ready_s"] < f["rejoin_s"] < 30
    # It loaded every slot of its gpu (16 a layer, all filled by the plan) through the loader.
    assert f["experts_loaded_on_rejoin"] == 6 * 16
    # Routing reaches it again and it serves what reaches it; none was sent to it while it was gone.
    assert 0 < f["dispatches_to_rejoined"] < f["dispatches_served_by_rejoined"]
    assert f["dispatches_to_dead_after_recovery"] == 0
    # Its two lives' tokens: up to the death, then from the join on.
    assert s["tokens_routed"] == (2 * 400 + 20 + 400 - f["rejoined_step"]) * 1024
    assert s["dispatches_checked"] + f["dispatches_lost"] == s["tokens_routed"] * 4 * 6
    # The service planned it in again (SetRanksDown up) and has every rank on one version.
    assert s["service_down_ranks"] == []
    acked = s["service_acked_versions"]
    assert acked[0] == acked[1] == acked[2] >= f["rejoin_version"], log
    assert "rank 1 restarted at step 40" in proc.stdout
    assert f"rank 1 rejoined at step {f['rejoined_step']} (v{f['rejoin_version']})" in proc.stdout


def test_demo_refuses_bad_failure_flags(capsys):
    # --seconds 4 is 200 steps of 20 ms.
    for argv, message in (
        (["--fail-rank", "3", "--fail-at", "10"], "--fail-rank must be in [0, 2] (a rank of --ranks 3), got 3"),
        (["--fail-rank", "-1", "--fail-at", "10"], "--fail-rank must be in [0, 2] (a rank of --ranks 3), got -1"),
        (
            ["--fail-rank", "1", "--fail-at", "200"],
            "--fail-at must be in [1, 199] (a step of the run: --seconds 4 is 200 steps), got 200",
        ),
        (
            ["--fail-rank", "1", "--fail-at", "0"],
            "--fail-at must be in [1, 199] (a step of the run: --seconds 4 is 200 steps), got 0",
        ),
        (["--fail-rank", "1"], "--fail-rank R and --fail-at STEP go together: give both or neither"),
        (["--fail-at", "5"], "--fail-rank R and --fail-at STEP go together: give both or neither"),
        (["--fail-rank", "1", "--fail-at", "5", "--draft-layers", "1"], "--fail-rank runs without --draft-layers"),
        (
            ["--fail-rank", "1", "--fail-at", "10", "--rejoin-at", "10"],
            "--rejoin-at must be in [11, 199] (after --fail-at 10, a step of the run: --seconds 4 is 200 steps), "
            "got 10",
        ),
        (
            ["--fail-rank", "1", "--fail-at", "10", "--rejoin-at", "200"],
            "--rejoin-at must be in [11, 199] (after --fail-at 10, a step of the run: --seconds 4 is 200 steps), "
            "got 200",
        ),
        (
            ["--rejoin-at", "50"],
            "--rejoin-at STEP restarts the rank --fail-rank R killed at --fail-at STEP: give those too",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["demo", "--ranks", "3", "--seconds", "4", *argv])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, (argv, err)


def test_with_a_rank_to_lose_the_survivors_have_a_slot_for_every_expert():
    for ranks in (2, 3, 4, 8):
        kept = DemoConfig(ranks=ranks).topology
        failing = DemoConfig(ranks=ranks, fail_rank=0, fail_at=1).topology
        assert failing.slots_per_gpu * (ranks - 1) >= failing.num_experts
        assert failing.slots_per_gpu >= kept.slots_per_gpu


def test_lost_experts_counts_pairs_with_every_replica_on_the_dead_gpus():
    topo = eplb.Topology(2, 6, 9, 3)  # contiguous: gpu 1 alone holds experts 3, 4, 5; gpu 2 has 0, 1, 2 again
    phy2log = eplb.Placement.contiguous(topo).phy2log.copy()
    assert lost_experts(phy2log, 3, [1]) == 2 * 3
    phy2log[0, 0] = 4  # layer 0: expert 4 also on gpu 0
    assert lost_experts(phy2log, 3, [1]) == 5 and lost_experts(phy2log, 3, [0, 1]) == 2 * 3


def test_slot_counts_fold_past_the_empty_slots_of_a_gpu_down():
    """A survivor switch in chunks routes a mixed map with -1 slots; folding its counts to
    experts raised (bincount of a negative index) before the fix."""
    import torch

    from eplb_engine.balanced_rank import fold_slot_counts

    topo = eplb.Topology(2, 4, 6, 3)
    phy2log = np.array([[0, 1, -1, -1, 2, 3], [0, 1, 2, 3, -1, -1]])
    placement = eplb.Placement(phy2log, topo)
    counts = np.array([[5, 6, 0, 0, 7, 8], [1, 2, 3, 4, 0, 0]])
    want = [[5, 6, 7, 8], [1, 2, 3, 4]]
    np.testing.assert_array_equal(fold_slot_counts(counts, placement), want)
    np.testing.assert_array_equal(fold_slot_counts(torch.from_numpy(counts), placement).numpy(), want)


def test_the_summary_reads_the_lowest_surviving_rank_and_counts_the_dead_ones_steps():
    cfg = DemoConfig(ranks=3, seconds=1.0, fail_rank=0, fail_at=10)
    steps = cfg.steps

    def result(rank: int, routed_steps: int, dead: bool = False) -> dict:
        reporter = {"accepted": 1, "dropped_reports": 0, "dropped_adds": 0}
        series = [1.0 + rank] * routed_steps
        model = {"misrouted": 0, "routed": routed_steps * 10, "series": series, "reporter": reporter}
        out = {"rank": rank, "seconds": 1.0, "steps_routed": routed_steps, "events": [], "late": 0}
        out["models"] = {"target": model}
        if dead:
            return {**out, "dead": True}
        view = {"dead": [0], "step": 10, "detected_wall": 100.01, "experts_lost": 3, "survivor_version": 2}
        view |= {"recovered_step": 14, "recovered_wall": 100.2, "recovered_version": 2, "dispatches_lost": 7}
        view |= {"dispatches_to_dead_after": 0, "regroup_s": 0.05, "restored": rank, "restored_from_host": 1}
        return {**out, "failure": view}

    results = {2: result(2, steps), 0: result(0, 10, dead=True), 1: result(1, steps)}
    s = _summary(cfg, results, 2.0, {0: 100.0})
    assert s["imbalance_final"] == pytest.approx(2.0)  # rank 1's series: the lowest survivor's
    assert s["tokens_routed"] == (2 * steps + 10) * cfg.tokens
    assert s["dispatches_checked"] == (2 * steps + 10) * 10 - 14
    (f,) = s["failures"]
    assert f["experts_reloaded"] == 3 and f["dispatches_lost"] == 14 and f["recovered_step"] == 14
    assert f["recovery_s"] == pytest.approx(0.2) and f["detect_s"] == pytest.approx(0.01)


def test_the_summary_counts_a_restarted_ranks_second_life():
    cfg = DemoConfig(ranks=3, seconds=1.0, fail_rank=1, fail_at=10, rejoin_at=20)
    steps = cfg.steps

    def result(rank: int, routed_steps: int, **extra: object) -> dict:
        reporter = {"accepted": 1, "dropped_reports": 0, "dropped_adds": 0}
        model = {"misrouted": 0, "routed": routed_steps * 10, "series": [1.0] * steps, "reporter": reporter}
        out = {"rank": rank, "seconds": 1.0, "steps_routed": routed_steps, "events": [], "late": 0}
        return {**out, "models": {"target": model}, **extra}

    view = {"dead": [1], "step": 10, "detected_wall": 100.01, "experts_lost": 3, "survivor_version": 2}
    view |= {"recovered_step": 14, "recovered_wall": 100.2, "recovered_version": 2, "dispatches_lost": 7}
    view |= {"dispatches_to_dead_after": 0, "regroup_s": 0.05, "restored": 3, "restored_from_host": 3}
    view |= {"rejoined_step": 30, "dispatches_to_rejoined": 5}
    back = {"step": 30, "ready_wall": 101.0, "serving_wall": 101.5, "join_s": 0.04, "experts_loaded": 96}
    back |= {"moves": 4, "version": 3, "served": 11, "service_error": ""}
    results = {0: result(0, steps, failure=view), 1: result(1, 10, dead=True), 2: result(2, steps, failure=view)}
    s = _summary(cfg, results, 2.0, {1: 100.0}, {1: result(1, steps - 30, rejoin=back)}, {1: 100.5})
    assert s["tokens_routed"] == (2 * steps + 10 + steps - 30) * cfg.tokens
    assert s["dispatches_checked"] == (2 * steps + 10 + steps - 30) * 10 - 14
    (f,) = s["failures"]
    assert (f["rejoined_step"], f["rejoin_version"], f["experts_loaded_on_rejoin"]) == (30, 3, 96)
    assert f["rejoin_s"] == pytest.approx(1.0) and f["rejoin_ready_s"] == pytest.approx(0.5)
    assert f["dispatches_to_rejoined"] == 10 and f["dispatches_served_by_rejoined"] == 11 and f["rejoined_steps_agree"]

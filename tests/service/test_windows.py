"""Load windows and their blobs, without a server."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_service.windows import WindowSpec, encode_blob, make_window, sum_blobs

SHAPE = (2, 3)


def test_sliding_time_window_expires_whole_buckets():
    w = make_window(SHAPE, WindowSpec(duration_s=10.0, buckets=5))
    w.add(np.ones(SHAPE), now=0.0)
    w.add(np.ones(SHAPE), now=5.0)
    w.add(np.ones(SHAPE), now=9.0)
    assert w.total(9.0)[1] == 3
    sums, n = w.total(13.0)  # the bucket [0, 2) is older than 13 - 10 = 3 in full
    assert n == 2 and np.array_equal(sums, np.full(SHAPE, 2.0))
    assert w.total(30.0)[1] == 0


def test_sliding_count_window_keeps_the_last_reports():
    w = make_window(SHAPE, WindowSpec(duration_s=0.0, report_count=4, buckets=2))
    for i in range(10):
        w.add(np.full(SHAPE, float(i)), now=float(i))
    sums, n = w.total(10.0)
    # Buckets of 2 reports: the newest two, reports 6..9 (it used to keep three buckets, 6 reports).
    assert n == 4 and sums[0, 0] == sum(range(6, 10))


@pytest.mark.parametrize("report_count", [1, 2, 5, 9, 10, 11, 37])
@pytest.mark.parametrize("buckets", [1, 2, 10])
def test_a_count_window_never_holds_more_than_its_report_count(report_count, buckets):
    # The reviewer's case: report_count 2, 5, 9 or 10 kept 11 reports, 11 kept 22.
    w = make_window(SHAPE, WindowSpec(duration_s=0.0, report_count=report_count, buckets=buckets))
    least = report_count - -(-report_count // buckets) + 1
    for i in range(60):
        w.add(np.full(SHAPE, float(i)), now=float(i))
        sums, n = w.total(float(i))
        assert min(i + 1, least) <= n <= report_count
        # Always the newest reports.
        assert sums[0, 0] == sum(range(i + 1 - n, i + 1))


def test_a_time_window_never_reaches_back_further_than_its_duration():
    w = make_window(SHAPE, WindowSpec(duration_s=10.0, buckets=10))
    for t in range(100):
        w.add(np.full(SHAPE, float(t)), now=float(t))
        sums, n = w.total(t + 0.5)
        # Reports at t-9 .. t: one bucket a second, each began within the last 10 s.
        assert n == min(t + 1, 10) and sums[0, 0] == sum(range(max(0, t - 9), t + 1))


def test_decay_window_halves_per_half_life():
    w = make_window(SHAPE, WindowSpec(kind="decay", half_life_s=2.0, duration_s=0.0))
    w.add(np.full(SHAPE, 8.0), now=0.0)
    w.add(np.full(SHAPE, 4.0), now=2.0)
    sums, n = w.total(4.0)
    assert n == 2 and sums[0, 0] == pytest.approx(2.0 + 2.0)


def test_blobs_sum_across_replicas_and_drop_stale_ones():
    a = make_window(SHAPE, WindowSpec(duration_s=60.0))
    b = make_window(SHAPE, WindowSpec(kind="decay", half_life_s=1.0, duration_s=0.0))
    a.add(np.ones(SHAPE), now=100.0)
    b.add(np.full(SHAPE, 4.0), now=100.0)
    blobs = {"a": encode_blob(a, 100.0), "b": encode_blob(b, 100.0), "old": encode_blob(a, 10.0), "junk": b"xx"}
    # Header (magic, kind, time, reports, half-life), the dtype byte, whole sums as int32.
    assert len(blobs["a"]) == 29 + 1 + 6 * 4 and blobs["a"][:4] == b"EPW2"
    sums, n, stale = sum_blobs(blobs, SHAPE, now=101.0, stale_after_s=60.0)
    assert np.allclose(sums, 1.0 + 2.0) and n == 2 and sorted(stale) == ["junk", "old"]


def test_a_blob_is_as_wide_as_its_sums_need_and_float64_epw1_blobs_still_read():
    whole, half = make_window(SHAPE, WindowSpec(duration_s=60.0)), make_window(SHAPE, WindowSpec(duration_s=60.0))
    whole.add(np.full(SHAPE, 2.0**31), now=100.0)  # over int32: int64
    half.add(np.full(SHAPE, 0.1), now=100.0)  # not exact in float32: float64
    assert len(encode_blob(whole, 100.0)) == 30 + 6 * 8 and len(encode_blob(half, 100.0)) == 30 + 6 * 8
    # A blob an instance from before 1.0 flushed (EPW1: the header, then float64 sums).
    header = encode_blob(half, 100.0)[:29]
    epw1 = b"EPW1" + header[4:] + np.full(SHAPE, 3.0, dtype="<f8").tobytes()
    blobs = {"new": encode_blob(whole, 100.0), "old-format": epw1}
    sums, n, stale = sum_blobs(blobs, SHAPE, now=100.0, stale_after_s=60.0)
    assert np.array_equal(sums, np.full(SHAPE, 2.0**31 + 3.0)) and n == 2 and stale == []


def test_a_blob_with_an_infinite_sum_is_left_out():
    a = make_window(SHAPE, WindowSpec(duration_s=60.0))
    a.add(np.ones(SHAPE), now=100.0)
    poisoned = make_window(SHAPE, WindowSpec(duration_s=60.0))
    with np.errstate(over="ignore"):  # what two uncapped reports of 1e308 did to a window
        poisoned.add(np.full(SHAPE, 1e308), now=100.0)
        poisoned.add(np.full(SHAPE, 1e308), now=100.0)
    blobs = {"a": encode_blob(a, 100.0), "poisoned": encode_blob(poisoned, 100.0)}
    sums, n, stale = sum_blobs(blobs, SHAPE, now=101.0, stale_after_s=60.0)
    assert np.array_equal(sums, np.ones(SHAPE)) and n == 1 and stale == ["poisoned"]


def test_a_bucket_is_int32_for_token_counts_and_widens_only_when_it_must():
    w = make_window(SHAPE, WindowSpec(duration_s=60.0, buckets=2))
    w.add(np.full(SHAPE, 7, dtype=np.int32), now=0.0)
    w.add(np.full(SHAPE, 5.0), now=1.0)  # whole counts sent as float64 stay whole
    assert [b[2].dtype for b in w._buckets] == [np.int32]  # half the memory of float64
    sums, n = w.total(1.0)
    assert sums.dtype == np.int64 and np.array_equal(sums, np.full(SHAPE, 12)) and n == 2
    # A sum past 2^31 - 1 widens its bucket to int64, exactly.
    big = np.full(SHAPE, 2**31 - 10, dtype=np.int64)
    w.add(big, now=2.0)
    assert w._buckets[-1][2].dtype == np.int64
    assert np.array_equal(w.total(2.0)[0], np.full(SHAPE, 12 + 2**31 - 10))
    # A fraction makes the bucket float64; the total is float64 then, and still exact here.
    w.add(np.full(SHAPE, 0.5), now=40.0)
    assert w._buckets[-1][2].dtype == np.float64
    assert np.array_equal(w.total(40.0)[0], np.full(SHAPE, 12 + 2**31 - 10 + 0.5))

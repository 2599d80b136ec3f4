"""Load traces: every reader round-trips, windows are right, bad input names field and expectation."""

import numpy as np
import pytest

from eplb import traces


def _trace(T=3, L=2, E=5) -> traces.LoadTrace:
    counts = np.arange(T * L * E, dtype=np.float64).reshape(T, L, E)
    return traces.LoadTrace(counts, {"model": "tiny"})


def test_native_round_trip_keeps_counts_and_meta():
    tr = _trace()
    doc = traces.to_native(tr)
    assert doc["format"] == "eplb-trace" and doc["version"] == 1
    assert (doc["num_steps"], doc["num_layers"], doc["num_experts"]) == (3, 2, 5)
    back = traces.from_native(doc)
    assert np.array_equal(back.counts, tr.counts)
    assert back.meta == {"model": "tiny"}


def test_two_d_counts_get_a_time_axis_of_one():
    tr = traces.from_counts_json({"counts": [[1, 2, 3], [4, 5, 6]]})
    assert tr.counts.shape == (1, 2, 3)
    assert tr.window().tolist() == [[1, 2, 3], [4, 5, 6]]


def test_csv_long_and_wide_layouts_round_trip():
    tr = _trace()
    assert np.array_equal(traces.from_csv_rows(traces.to_csv_rows(tr)).counts, tr.counts)
    wide = traces.from_csv_rows([["1", "2", "3"], ["4", "5", "6.5"]])
    assert wide.counts.tolist() == [[[1, 2, 3], [4, 5, 6.5]]]
    # A long table without a step column is one step; missing pairs are 0.
    long = traces.from_csv_rows([["layer", "expert", "count"], ["0", "2", "7"], ["1", "0", "3"]])
    assert long.counts.tolist() == [[[0, 0, 7], [3, 0, 0]]]


def test_window_last_and_half_life():
    tr = _trace()
    assert np.array_equal(tr.window(last=1), tr.counts[-1])
    assert np.array_equal(tr.window(last=2), tr.counts[1] + tr.counts[2])
    # Half-life 1: weights 0.25, 0.5, 1 from oldest to newest.
    assert np.allclose(tr.window(half_life=1.0), 0.25 * tr.counts[0] + 0.5 * tr.counts[1] + tr.counts[2])
    with pytest.raises(ValueError, match="last must be between 1 and the trace's 3 steps"):
        tr.window(last=4)


def test_sglang_dump_and_vllm_window():
    counts = np.arange(12).reshape(2, 1, 6)
    assert np.array_equal(traces.from_sglang_dump({"logical_count": counts}).counts, counts)
    # 4 experts in 6 slots: experts 0 and 1 have two replicas each.
    phy2log = np.array([[0, 1, 2, 3, 0, 1]])
    window = np.array([[[1, 2, 3, 4, 10, 20]], [[0, 0, 0, 1, 0, 0]]])
    tr = traces.from_vllm_window(window, phy2log)
    assert tr.counts.tolist() == [[[11, 22, 3, 4]], [[0, 0, 0, 1]]]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"format": "other", "version": 1, "counts": [[1]]}, "field 'format': expected 'eplb-trace', got 'other'"),
        ({"format": "eplb-trace", "version": 2, "counts": [[1]]}, "field 'version': expected 1, got 2"),
        ({"format": "eplb-trace", "version": 1}, "field 'counts': missing"),
        (
            {"format": "eplb-trace", "version": 1, "counts": [[1, 2], [3]]},
            "field 'counts': expected a rectangular numeric array",
        ),
        (
            {"format": "eplb-trace", "version": 1, "counts": [[1, -2]]},
            r"field 'counts': expected finite counts >= 0, got -2.0 at index \[0, 1\]",
        ),
        (
            {"format": "eplb-trace", "version": 1, "counts": [1, 2]},
            r"field 'counts': expected shape \[layers, experts\] or \[steps, layers, experts\], got \[2\]",
        ),
        (
            {"format": "eplb-trace", "version": 1, "num_experts": 3, "counts": [[1, 2]]},
            "field 'num_experts': declares 3 but 'counts' has 2",
        ),
    ],
)
def test_malformed_native_trace_names_field_and_expectation(doc, message):
    with pytest.raises(ValueError, match=message):
        traces.from_native(doc)


def test_malformed_csv_names_line_and_column():
    with pytest.raises(ValueError, match="line 3, column 'count': expected a number"):
        traces.from_csv_rows([["layer", "expert", "count"], ["0", "0", "1"], ["0", "1", "x"]])
    with pytest.raises(ValueError, match="line 2, column 'expert': expected an integer index >= 0, got 1.5"):
        traces.from_csv_rows([["layer", "expert", "count"], ["0", "1.5", "1"]])
    with pytest.raises(ValueError, match="line 2: expected 3 columns like line 1"):
        traces.from_csv_rows([["1", "2", "3"], ["4", "5"]])
    with pytest.raises(ValueError, match="header: expected columns layer, expert, count"):
        traces.from_csv_rows([["layer", "count"], ["0", "1"]])


def test_vllm_window_shape_mismatch_is_named():
    with pytest.raises(
        ValueError,
        match=r"field 'physical_to_logical': expected shape \[layers, slots\] = \[1, 6\] to match 'window', got \[1, 5\]",
    ):
        traces.from_vllm_window(np.ones((2, 1, 6)), np.zeros((1, 5), dtype=int))

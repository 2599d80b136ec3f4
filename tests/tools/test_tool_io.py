"""File I/O: every trace and placement format round-trips through disk; bad files name the file."""

import json
import sys

import numpy as np
import pytest

import eplb
from eplb import traces
from eplb.workloads import make_loads
from eplb_tools import io as eio


@pytest.fixture()
def trace() -> traces.LoadTrace:
    rng = np.random.default_rng(0)
    return traces.LoadTrace(rng.integers(0, 1000, (4, 3, 8)).astype(float), {"model": "tiny"})


@pytest.mark.parametrize(
    ("fmt", "suffix"), [("native", "json"), ("json", "json"), ("npy", "npy"), ("npz", "npz"), ("csv", "csv")]
)
def test_trace_formats_round_trip_through_files(tmp_path, trace, fmt, suffix):
    path = tmp_path / f"trace.{suffix}"
    eio.write_trace(path, trace, fmt)
    assert eio.trace_format_of(path) == fmt
    assert np.array_equal(eio.read_trace(path).counts, trace.counts)


def test_vllm_window_archive_is_read_with_its_map(tmp_path):
    phy2log = np.array([[0, 1, 2, 0], [2, 1, 0, 1]])
    window = np.arange(16).reshape(2, 2, 4)
    path = tmp_path / "window.npz"
    np.savez(path, window=window, physical_to_logical=phy2log)
    got = eio.read_trace(path)
    assert got.counts.tolist() == [[[3, 1, 2], [6, 12, 4]], [[19, 9, 10], [14, 28, 12]]]
    np.savez(path, window=window)
    with pytest.raises(ValueError, match=f"{path}: field 'physical_to_logical': missing"):
        eio.read_trace(path)
    assert eio.read_trace(path, phy2log=phy2log).counts.shape == (2, 2, 3)


def test_sglang_pt_without_torch_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed: import fails
    path = tmp_path / "dump.pt"
    path.write_bytes(b"not really")
    with pytest.raises(
        ValueError,
        match=r"dump.pt: reading SGLang .pt dumps needs torch; install it with `pip install 'eplb\[torch\]'`",
    ):
        eio.read_trace(path)


@pytest.mark.parametrize(
    ("fmt", "suffix"), [("native", "json"), ("sglang", "json"), ("vllm", "npz"), ("listing", "txt")]
)
def test_placement_formats_round_trip_through_files(tmp_path, fmt, suffix):
    topo = eplb.Topology(3, 16, 20, 4, 2, 4)
    loads = make_loads("lognormal-1.0", topo)
    placement = eplb.rebalance(loads, topo, "auto").placement
    path = tmp_path / f"placement.{suffix}"
    assert eio.write_placement(path, placement, fmt, stats={"x": 1}, loads=loads) == fmt
    assert eio.placement_format_of(path) == fmt
    assert eio.read_placement(path, num_gpus=4, num_nodes=2, num_groups=4) == placement


def test_malformed_files_name_file_field_and_expectation(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"counts": [[1, 2]')
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON \(line 1, column 19"):
        eio.read_trace(bad_json)
    no_counts = tmp_path / "nocounts.json"
    no_counts.write_text(json.dumps({"cnt": [[1]]}))
    with pytest.raises(
        ValueError,
        match=r"nocounts.json: field 'counts': missing; expected counts\[layer\]\[expert\] \(fields present: cnt\)",
    ):
        eio.read_trace(no_counts)
    csv = tmp_path / "t.csv"
    csv.write_text("layer,expert,count\n0,0,5\n0,1,oops\n")
    with pytest.raises(ValueError, match="t.csv: line 3, column 'count': expected a number"):
        eio.read_trace(csv)
    npz = tmp_path / "t.npz"
    np.savez(npz, weights=np.ones((2, 2)))
    with pytest.raises(
        ValueError,
        match=r"t.npz: field 'counts': missing; expected an array named counts or logical_count \(archive has: weights\)",
    ):
        eio.read_trace(npz)
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 1]]}))
    with pytest.raises(ValueError, match=r"sg.json: sglang placements do not record the gpu count; pass num_gpus"):
        eio.read_placement(sg)
    with pytest.raises(
        ValueError,
        match=r"sg.json: field 'physical_to_logical_map': num_slots \(3\) must be a multiple of num_gpus \(2\)",
    ):
        eio.read_placement(sg, num_gpus=2)
    (tmp_path / "trace.bin").write_text("x")
    with pytest.raises(ValueError, match=r"trace.bin: cannot tell the trace format from suffix '.bin'"):
        eio.read_trace(tmp_path / "trace.bin")


def test_topology_config_json_and_toml(tmp_path):
    toml = tmp_path / "topo.toml"
    toml.write_text("[topology]\nlayers = 2\nexperts = 16\nslots = 20\ngpus = 4\nnodes = 2\n")
    assert eio.read_topology(toml) == eplb.Topology(2, 16, 20, 4, 2, 1)
    js = tmp_path / "topo.json"
    js.write_text(json.dumps({"num_layers": 2, "num_experts": 16, "num_slots": 20}))
    with pytest.raises(ValueError, match=r"topo.json: field 'topology.num_gpus': missing; expected a positive integer"):
        eio.read_topology(js)

"""Flags of `eplb place` and `eplb-bench` that disagree with each other or with the topology:
each error names the flags (or where a value came from), not the library's parameters, and no
flag given is silently left unused."""

import numpy as np
import pytest

from eplb_bench import cli

SMALL = ["--synthetic", "zipf-1.0", "--scale", "small", "--policy", "global", "--effort", "fast"]


def _err(capsys, argv: list[str], tool=cli.main) -> str:
    assert tool(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [*SMALL, "--slots", "7"],
            "slots (7, --slots) must be >= experts (16, from --scale small): every expert needs at least one slot",
        ),
        (
            [*SMALL, "--gpus", "40"],
            "slots (20, from --scale small) must be a multiple of gpus (40, --gpus) so every gpu has the same",
        ),
        ([*SMALL, "--nodes", "3"], "gpus (4, from --scale small) must be a multiple of nodes (3, --nodes)"),
    ],
)
def test_place_topology_errors_name_the_flags(capsys, argv, message):
    err = _err(capsys, ["place", *argv])
    assert message in err and "num_" not in err


def test_place_topology_errors_name_the_trace_and_the_config(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((2, 16)))
    err = _err(capsys, ["place", str(tmp_path / "t.npy"), "--slots", "10", "--gpus", "2"])
    assert "slots (10, --slots) must be >= experts (16, from the trace)" in err
    (tmp_path / "d.toml").write_text("[topology]\nlayers = 2\nexperts = 16\nslots = 20\ngpus = 4\n")
    err = _err(capsys, ["place", str(tmp_path / "t.npy"), "--topology", str(tmp_path / "d.toml"), "--gpus", "3"])
    assert f"slots (20, from {tmp_path / 'd.toml'}) must be a multiple of gpus (3, --gpus)" in err

"""rebalance(workers=k) from a script: without the ``__main__`` guard each worker re-imports the
script; the caller gets one ValueError naming the guard, not multiprocessing's RuntimeError and
a BrokenProcessPool (and no leaked-semaphore warnings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_BODY = """
import eplb
from eplb.workloads import SCALES, make_loads
topo = SCALES["v3-prefill"]
print("planning", flush=True)
{call}
"""
_CALL = 'plan = eplb.rebalance(make_loads("lognormal-1.0", topo), topo, "global", workers=2)\nprint("done")'


def _run(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "plan_script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_unguarded_script_gets_one_value_error_naming_the_guard(tmp_path: Path) -> None:
    r = _run(tmp_path, _BODY.format(call=_CALL))
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: workers=2:"), r.stderr
    assert 'if __name__ == "__main__":' in last
    assert "bootstrapping phase" not in r.stderr
    assert "BrokenProcessPool" not in r.stderr
    assert "leaked semaphore" not in r.stderr
    # The workers stopped at their rebalance call: none got to the end of the script.
    assert "done" not in r.stdout


def test_guarded_script_plans(tmp_path: Path) -> None:
    guarded = _BODY.format(call='if __name__ == "__main__":\n    ' + _CALL.replace("\n", "\n    "))
    r = _run(tmp_path, guarded)
    assert r.returncode == 0, r.stderr
    # Once, from the caller (a worker's own "planning" line may come after it, or even inside
    # it, between "done" and its newline: workers import the script's top level too, and
    # print unbuffered to the same pipe).
    assert r.stdout.count("done") == 1, r.stdout

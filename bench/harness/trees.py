"""Two trees of ``eplb`` timed against each other: a ``--serve`` process of a bench module per
tree (this one, and ``DIR/eplb`` through ``PYTHONPATH``), asked in turn line by line, so that a
shared machine's drift hits both alike (``replan_bench --baseline``, ``default_bench --baseline``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["TreePair"]


class TreePair:
    """``module``'s ``--serve`` (plus ``args``) running on this tree (``"this"``) and on
    ``baseline``'s ``eplb`` (``"baseline"``); ``ask(tree, line)`` sends one request line and
    returns the JSON answer line. Use as a context manager: the processes end on exit."""

    TREES = ("baseline", "this")

    def __init__(self, module: str, baseline: str, args: tuple[str, ...] = ()) -> None:
        self.baseline = baseline
        envs = {"baseline": {**os.environ, "PYTHONPATH": os.path.abspath(baseline)}, "this": dict(os.environ)}
        cmd = [sys.executable, "-m", module, "--serve", *args]
        # From a neutral directory, so that the working directory shadows neither tree.
        self.procs = {
            k: subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=envs[k], cwd="/")
            for k in self.TREES
        }

    def ask(self, tree: str, line: str) -> list:
        proc = self.procs[tree]
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline()
        if not answer:
            raise SystemExit(f"the {tree} tree's process ended (is {self.baseline}/eplb there?)")
        return json.loads(answer)

    def __enter__(self) -> TreePair:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            proc.stdin.close()
            proc.wait()

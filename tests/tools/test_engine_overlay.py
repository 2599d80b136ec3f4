"""engines/overlay.py's graft: a later release's definitions appended to the pinned file, for a
module neither release's copy of can stand in alone (vLLM 0.34.0's ``vllm/config/utils.py``
beside 0.32.0)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _overlay():
    """``engines/overlay.py`` (a script, not a package) as a module."""
    spec = importlib.util.spec_from_file_location("engines_overlay", ROOT / "engines" / "overlay.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_graft_appends_the_later_definitions_to_the_pinned_file():
    overlay = _overlay()
    later = (
        "import x\n\nCompileFactors = dict[str, object]\n\n\n@runtime_checkable\nclass P(Protocol):\n"
        "    def f(self): ...\n\n\ndef hash_config_cached(c):\n    return 1\n\n\ndef dropped():\n    pass\n"
    )
    got = overlay.graft("def compute_hash_cached(c):\n    return 0\n", later, ["hash_config_cached", "P"], "v's u.py")
    assert got == (
        "def compute_hash_cached(c):\n    return 0\n\n# Grafted by eplb's engines/overlay.py from v's u.py: "
        "hash_config_cached, P\n@runtime_checkable\nclass P(Protocol):\n    def f(self): ...\n\n\n"
        "def hash_config_cached(c):\n    return 1\n"
    )
    assert overlay.split_graft("a/u.py:f,g") == ("a/u.py", ["f", "g"]) and overlay.split_graft("a/b") == ("a/b", [])
    with pytest.raises(SystemExit, match=r"v's u.py defines no \['missing'\]"):
        overlay.graft("", later, ["missing"], "v's u.py")

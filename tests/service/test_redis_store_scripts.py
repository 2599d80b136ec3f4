"""The store's Lua scripts are package data: every file in scripts/ is shipped by
pyproject.toml's package-data glob and loads through importlib.resources."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

from eplb_service.redis_store import lua

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "service" / "redis_store" / "scripts"


def test_every_script_file_is_shipped_and_loads_as_written():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "eplb_service.redis_store" in setup["packages"]
    shipped = {p for pattern in setup["package-data"]["eplb_service.redis_store"] for p in SCRIPTS.parent.glob(pattern)}
    files = set(SCRIPTS.glob("*.lua"))
    assert files and shipped == files
    for path in files:
        assert lua.source(path.stem) == path.read_text()


def test_a_script_is_called_by_the_sha1_of_its_file():
    script = lua.Script(None, "ack")  # type: ignore[arg-type]  # no call is made
    assert script.sha == hashlib.sha1((SCRIPTS / "ack.lua").read_bytes()).hexdigest()

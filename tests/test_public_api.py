"""The public API is each public package's ``__all__``: every name there exists and is documented
(scripts/api_docs.sh builds the reference from the same names)."""

import importlib
import importlib.util
import types

import pdoc.doc
import pytest

PUBLIC = ("eplb", "eplb_wire", "eplb_engine")


def _docstring(package: str, name: str) -> str:
    module = importlib.import_module(package)
    if not hasattr(module, name):  # a submodule the package names (eplb_wire.arrays)
        return importlib.import_module(f"{package}.{name}").__doc__ or ""
    if isinstance(getattr(module, name), types.ModuleType):
        return getattr(module, name).__doc__ or ""
    # pdoc's reading, which also finds a constant's docstring (the string after its assignment).
    return pdoc.doc.Module(module).members[name].docstring


@pytest.mark.parametrize("package", PUBLIC)
def test_every_name_in_all_exists_once(package):
    module = importlib.import_module(package)
    names = module.__all__
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(module, name) or importlib.util.find_spec(f"{package}.{name}"), name


@pytest.mark.parametrize("package", PUBLIC)
def test_every_public_name_has_a_docstring(package):
    module = importlib.import_module(package)
    assert (module.__doc__ or "").strip()
    assert [name for name in module.__all__ if not _docstring(package, name).strip()] == []


def test_a_constant_is_documented_by_the_string_after_it():
    assert _docstring("eplb", "EFFORTS").startswith("What ``effort``")
    assert _docstring("eplb_wire", "parts").startswith("Placements sent in parts")

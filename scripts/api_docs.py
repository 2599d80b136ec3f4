"""The API reference: pdoc's HTML of the public names, failing on what would make it wrong.

    python scripts/api_docs.py OUT_DIR

The public API is each public package's ``__all__`` (``PACKAGES``; a module named there is
documented with its own ``__all__``). The build fails when a public name has no docstring, when a
docstring names an ``eplb*`` object (``eplb.Plan``, :class:`ArrayError`, ...) that does not
resolve, or when pdoc warns (an import or annotation it could not read).
"""

from __future__ import annotations

import importlib
import re
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pdoc
import pdoc.doc

PACKAGES = ("eplb", "eplb_wire", "eplb_engine")
# Names in docstrings that look like Python objects and are not: the proto package.
NOT_PYTHON = {"eplb.v1"}
# ``eplb.Plan``, `eplb_wire.arrays`, :class:`ArrayError`, :mod:`eplb_wire.arrays`, :func:`encode`
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([\w.]+)`")
_CODE = re.compile(r"``?((?:eplb|eplb_wire|eplb_engine|eplb_service|eplb_tools|eplb_bench)(?:\.\w+)+)``?")


def public(package: str) -> Iterator[tuple[pdoc.doc.Doc, bool]]:
    """The public documented objects of ``package``, each with whether it must have a docstring:
    its ``__all__`` (modules there recursively) must, the public members of each class among them
    are rendered (a dataclass's fields are documented in its docstring)."""
    module = pdoc.doc.Module.from_name(package)
    yield module, True
    names = getattr(module.obj, "__all__", None)
    if names is None:
        raise SystemExit(f"{package} has no __all__: list the names a user imports")
    for name in names:
        if hasattr(module.obj, name) and not isinstance(getattr(module.obj, name), type(sys)):
            member = module.members.get(name)
            if member is None:
                raise SystemExit(f"{package}.__all__ names {name!r}, which pdoc does not find")
            yield member, True
            if isinstance(member, pdoc.doc.Class):
                yield from ((m, False) for m in member.own_members if not m.name.startswith("_"))
        else:
            yield from public(f"{package}.{name}")


def resolves(ref: str, where: str) -> bool:
    """Whether ``ref`` names an object: dotted from a package, or relative to module ``where``."""
    for full in (ref, f"{where}.{ref}"):
        parts = full.split(".")
        for split in range(len(parts), 0, -1):
            try:
                obj: object = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            try:
                for attr in parts[split:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return True
    return False


def problems(package: str) -> list[str]:
    found = []
    for doc, required in public(package):
        if required and not doc.docstring.strip():
            found.append(f"{doc.fullname}: no docstring")
        refs = {*_ROLE.findall(doc.docstring), *_CODE.findall(doc.docstring)} - NOT_PYTHON
        found += [
            f"{doc.fullname}: {ref!r} does not resolve" for ref in sorted(refs) if not resolves(ref, doc.modulename)
        ]
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # pdoc reads a module's __dict__: load the names eplb_engine resolves on first access, and
        # the submodules an __all__ names.
        for package in PACKAGES:
            module = importlib.import_module(package)
            for name in module.__all__:
                if not hasattr(module, name):
                    importlib.import_module(f"{package}.{name}")
        found = [p for package in PACKAGES for p in problems(package)]
        # Only the public packages and the modules their __all__ names (and those modules' own
        # public submodules), never their other submodules.
        listed = sorted(
            f"{package}.{name}"
            for package in PACKAGES
            for name in importlib.import_module(package).__all__
            if isinstance(getattr(importlib.import_module(package), name), types.ModuleType)
        )
        listed += [
            f"{m}.{n}"
            for m in listed
            for n in getattr(importlib.import_module(m), "__all__", ())
            if isinstance(getattr(importlib.import_module(m), n), types.ModuleType)
        ]
        private = []
        for package in PACKAGES:
            own = [re.escape(m[len(package) + 1 :]) for m in listed if m.startswith(package + ".")]
            private.append(rf"!{re.escape(package)}\.(?!({'|'.join(own)})$)" if own else rf"!{re.escape(package)}\.")
        pdoc.pdoc(*PACKAGES, *private, output_directory=Path(argv[0]))
    found += [f"pdoc: {w.message}" for w in caught]
    for line in found:
        print(f"api docs: {line}", file=sys.stderr)
    if found:
        return 1
    pages = sorted(str(p.relative_to(argv[0])) for p in Path(argv[0]).rglob("*.html"))
    print(f"api docs: {len(pages)} pages in {argv[0]}: {', '.join(pages)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

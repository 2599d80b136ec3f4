"""Optional extras at the edge: which pip package a missing module comes from, and the one-line
error the tools print for it (``eplb serve``, ``eplb demo``, ``eplb-bench``, ``eplb place``)."""

from __future__ import annotations

import importlib

__all__ = ["PACKAGES", "missing", "require"]

# Import name -> the pip package that provides it, where they differ or the name is a
# namespace (``google`` is protobuf's): the message names what to install.
PACKAGES = {
    "google": "protobuf",
    "google.protobuf": "protobuf",
    "grpc": "grpcio",
    "grpc_tools": "grpcio-tools",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "grpc_status": "grpcio-status",
    "prometheus_client": "prometheus-client",
    "ortools": "ortools",
    "torch": "torch",
    "redis": "redis",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}


def package_of(module: str | None) -> str:
    """The pip package of ``module`` (a dotted name is looked up by its prefixes)."""
    if not module:
        return "unknown"
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in PACKAGES:
            return PACKAGES[name]
    return parts[0]


def missing(what: str, extra: str, exc: ImportError) -> str:
    """The error for a missing extra, e.g. ``the demo needs the demo extra (missing: redis);
    install it with: pip install 'eplb[demo]'`` (the tool prefixes ``eplb demo: error:``)."""
    return (
        f"{what} needs the {extra} extra (missing: {package_of(exc.name)}); "
        f"install it with: pip install 'eplb[{extra}]'"
    )


def require(*modules: str) -> None:
    """Import ``modules`` now, so that a missing extra shows before any work; raises the
    ``ImportError`` of the first that fails (its ``name`` is the module missing)."""
    for module in modules:
        importlib.import_module(module)

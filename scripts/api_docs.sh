#!/usr/bin/env bash
# The API reference: pdoc's HTML of the public API, each public package's __all__ (eplb,
# eplb_wire, eplb_engine). Fails on a public name without a docstring, a reference in a
# docstring that does not resolve, or a pdoc warning (scripts/api_docs.py; CI runs this).
#   scripts/api_docs.sh        build into a temp dir, removed at exit
#   scripts/api_docs.sh DIR    build into DIR (open DIR/index.html)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

if [ $# -ge 1 ]; then
  out=$1
else
  out=$(mktemp -d /tmp/eplb-api-docs.XXXXXX)
  trap 'rm -rf "$out"' EXIT
fi
"$PY" scripts/api_docs.py "$out"

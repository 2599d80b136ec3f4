#!/usr/bin/env bash
# The release as a user gets it: build the sdist and the wheel (python -m build: the wheel is
# built from the sdist, so both are proven), install the wheel, not editable, with the demo's
# extras into a fresh venv, and from outside the tree run the README's library example and a
# short `eplb demo`, then check that the package data shipped (CI runs this).
#   scripts/wheel_check.sh            build, install and check in a temp dir, removed at exit
#   KEEP=1 scripts/wheel_check.sh     keep the temp dir (its path is printed)
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$PWD
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

tmp=$(mktemp -d /tmp/eplb-wheel-check.XXXXXX)
[ "${KEEP:-}" = 1 ] && echo "wheel check in $tmp" || trap 'rm -rf "$tmp"' EXIT
step() { echo "wheel check: $* (${SECONDS} s)"; }

step "building the sdist and the wheel"
"$PY" -m build -o "$tmp/dist" . > "$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
# A setuptools deprecation (the license table was one) fails the release before it fails a build.
if grep -iE "deprecat" "$tmp/build.log"; then
  echo "python -m build warned of a deprecation (above); fix pyproject.toml" >&2
  exit 1
fi
wheel=$(ls "$tmp"/dist/*.whl)
ls "$tmp"/dist/*.tar.gz > /dev/null

step "installing $(basename "$wheel")[demo] and the CPU torch the README names"
python3 -m venv "$tmp/venv"
torch_pin=$(grep -oE "'torch==[^']+'" README.md | head -n 1 | tr -d "'")
"$tmp/venv/bin/pip" install -q "$wheel[demo]" "${torch_pin:-torch}" > "$tmp/pip.log" 2>&1 \
  || { grep -v "^WARNING: Location" "$tmp/pip.log"; exit 1; }

# Everything below runs in the temp dir, so `import eplb` can only find the installed wheel.
cd "$tmp"
step "the README's library example"
venv/bin/python - "$tree/README.md" > example.py <<'EOF'
import re
import sys

# The first python block under "## Library": the example as the README shows it.
text = open(sys.argv[1]).read().split("\n## Library\n", 1)[1]
print(re.search(r"```python\n(.*?)```", text, re.S).group(1))
EOF
venv/bin/python example.py
venv/bin/python - "$tree" <<'EOF'
import glob
import os
import sys
from importlib import resources

import eplb
import eplb.kernels
import eplb_engine
import eplb_service
import eplb_wire

tree = sys.argv[1]
site = os.path.dirname(os.path.dirname(eplb.__file__))
for module in (eplb, eplb_wire, eplb_service, eplb_engine):
    assert not module.__file__.startswith(tree + os.sep), f"{module.__name__} imported from the tree: {module.__file__}"
    assert os.path.dirname(os.path.dirname(module.__file__)) == site, f"{module.__name__} is not in {site}"
problems = []
for package in ("eplb", "eplb_wire"):
    if not resources.files(package).joinpath("py.typed").is_file():
        problems.append(f"{package}/py.typed is missing")
proto = resources.files("eplb_wire._gen.eplb.v1").joinpath("balancer.proto")
if not proto.is_file() or proto.read_text() != open(f"{tree}/proto/eplb/v1/balancer.proto").read():
    problems.append("eplb_wire/_gen/eplb/v1/balancer.proto is missing or differs from proto/eplb/v1/balancer.proto")


def names(root: str, pattern: str) -> set[str]:
    return {os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern), recursive=True)}


# Package data as the tree has it, so a new file (the store's Lua scripts) is checked once it lands.
for what, installed, folder, pattern in (
    ("kernel models", os.path.dirname(eplb.kernels.__file__), "eplb/kernels", "*.json"),
    ("Lua scripts", os.path.dirname(eplb_service.__file__), "service", "**/*.lua"),
):
    want, got = names(os.path.join(tree, folder), pattern), names(installed, pattern)
    if want != got:
        problems.append(f"{what}: the tree has {sorted(want)}, the wheel {sorted(got)}")
    elif got:
        print(f"  {len(got)} {what} shipped")
assert not problems, "; ".join(problems)
print(f"  installed in {site}: py.typed (eplb, eplb_wire), the proto, not editable")
EOF

step "a short eplb demo"
# 2 ranks for 8 s of routing: re-plans before and after the shift at mid-run, in well under a
# minute on 2 cores; the demo exits 1 on a misrouted token or a checksum mismatch.
venv/bin/eplb demo --ranks 2 --seconds 8 --json demo.json > demo.log 2>&1 || { cat demo.log; exit 1; }
grep -E "^summary:|re-plans applied" demo.log
venv/bin/python - <<'EOF'
import json

summary = json.load(open("demo.json"))
assert summary["replans_applied"] >= 1, f"the demo applied no re-plan: {summary['replans_applied']}"
assert summary["rollouts_failed"] == 0 and summary["misrouted_dispatches"] == 0, summary
EOF
step "passed"

#!/usr/bin/env bash
# mypy over every package, as pyproject.toml's [tool.mypy] configures it (CI runs this).
#   scripts/typecheck.sh [mypy options]
# The packages install from folders named otherwise (package-dir: wire/ is eplb_wire, ...) and
# mypy finds neither those names nor setuptools' editable finder: it reads the packages through
# links named as installed, in one place (its cache keeps the paths it read), and the paths it
# prints are mapped back to the folders.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

links=.mypy_cache/packages  # mypy prints paths under the current directory relative
rm -rf "$links" && mkdir -p "$links"
packages=()
sed_args=()
while read -r name dir; do
  ln -s "$PWD/$dir" "$links/$name"
  packages+=(-p "$name")
  sed_args+=(-e "s|$links/$name/|$dir/|g")
done < <("$PY" -c 'import tomllib
for name, folder in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"].items():
    print(name, folder)')
status=0
MYPYPATH="$PWD/$links" "$PY" -m mypy "$@" "${packages[@]}" > "$links.out" 2>&1 || status=$?
sed "${sed_args[@]}" "$links.out"
exit "$status"

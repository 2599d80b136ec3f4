#!/usr/bin/env bash
# The engine stage: each released engine in its own venv, and the adapter tests against its
# real classes.
#   scripts/engine_stage.sh            every engine under engines/
#   scripts/engine_stage.sh vllm       one of them
# engines/NAME/requirements.txt pins the engine (installed with --no-deps: the engines'
# full dependency trees are GPU stacks we do not need) and engines/NAME/deps.txt lists the few
# packages their EPLB and expert-location modules import, CPU torch among them. eplb itself goes
# in editable, without its own extras. The tests live in tests_engines/NAME/, outside the main
# suite's testpaths, so the rest of the suite runs without any engine installed.
set -euo pipefail
cd "$(dirname "$0")/.."
engines=("$@")
if [ ${#engines[@]} -eq 0 ]; then
  for f in engines/*/requirements.txt; do [ -e "$f" ] && engines+=("$(basename "$(dirname "$f")")"); done
fi
for name in "${engines[@]}"; do
  venv=".venv-$name"
  start=$(date +%s)
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q -r "engines/$name/deps.txt"
  "$venv/bin/pip" install -q --no-deps -r "engines/$name/requirements.txt"
  "$venv/bin/pip" install -q --no-deps -e .
  if [ -x "engines/$name/post_install.sh" ]; then
    PYTHON="$venv/bin/python" "engines/$name/post_install.sh"
  fi
  echo "engine stage: $name installed in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "tests_engines/$name"
done

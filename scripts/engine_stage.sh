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
# engines/NAME/overlays.txt names later releases whose Python files (vLLM 0.33.0's and 0.34.0's EPLB packages)
# are laid over the pinned install (engines/overlay.py): the tests run again against each.
# scripts/engine_release.sh ENGINE VERSION adds a new release (engines/release.py).
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
  start=$(date +%s)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider "tests_engines/$name"
  echo "engine stage: $name tests ran in $(( $(date +%s) - start )) s"
  # Later releases as overlays on the pinned install (engines/NAME/overlays.txt, engines/overlay.py):
  # the same tests again, PYTHONPATH putting the later release's files first;
  # EPLB_ENGINE_OVERLAY tells the tests which version and folder they must find.
  if [ -f "engines/$name/overlays.txt" ]; then
    while read -r requirement paths <&3; do
      case "$requirement" in '' | '#'*) continue ;; esac
      overlay="$venv/overlay-${requirement//=/}"
      start=$(date +%s)
      # shellcheck disable=SC2086  # the paths are words
      "$venv/bin/python" engines/overlay.py "$venv/bin/python" "$overlay" "$requirement" $paths
      EPLB_ENGINE_OVERLAY="${requirement##*==}:$PWD/$overlay" PYTHONPATH="$PWD/$overlay" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider "tests_engines/$name"
      echo "engine stage: $name with the $requirement overlay: $(( $(date +%s) - start )) s"
    done 3<"engines/$name/overlays.txt"
  fi
done

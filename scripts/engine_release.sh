#!/usr/bin/env bash
# A new engine release in one command:
#   scripts/engine_release.sh vllm 0.35.0
#   scripts/engine_release.sh sglang 0.5.24 [--dry-run]
# engines/release.py fetches the release's wheel (and the newest proven one's) into
# .engine-wheels/, prints the diff of the files eplb relies on (engines/ENGINE/watch.txt), and
# records the release (vLLM: an overlay line in overlays.txt; SGLang: the pin in
# requirements.txt); then the engine stage runs against it, the overlay built from the wheel
# fetched here. --dry-run prints the diff and the change it would make, and stops there.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 engines/release.py "$@"
for arg in "$@"; do [ "$arg" = "--dry-run" ] && exit 0; done
EPLB_OVERLAY_WHEELS="$PWD/.engine-wheels" bash scripts/engine_stage.sh "$1"

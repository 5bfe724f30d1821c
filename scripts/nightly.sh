#!/usr/bin/env bash
# Longer runs than CI's: the attribution property test with many more random schedules, then the soak.
# usage: scripts/nightly.sh [CASES] [SOAK_REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${1:-200000}
echo "[nightly] property test of attribution, $CASES random schedules"
PROPTEST_CASES=$CASES cargo test --release -q -p hscapture-worker fuzz
echo "[nightly] soak"
"${HSCAPTURE_VENV:-.venv}/bin/python" bench/soak.py --requests "${2:-20000}"

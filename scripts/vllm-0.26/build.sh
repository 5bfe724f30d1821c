#!/bin/bash
# The vLLM 0.26.0 payload for the offline H200 (the newest vLLM that pins torch 2.11), made as ../shared/gpu/vllm-0.23
# was (../shared/gpu/tools/build.sh, edited): writes .gpu/vllm-0.26/{bin,payload} (one part of ~51 MiB; no fatbins
# fallback). Needs a Python 3.12 venv with zstandard and triton (for ptxas) as PY312, e.g.
#   PYENV_VERSION=3.12.1 python3.12 -m venv /tmp/py312 && /tmp/py312/bin/pip install zstandard triton
# About 5 minutes (xz -9e). On the device: carry [".gpu/vllm-0.26"], run `bash .gpu/vllm-0.26/bin/install.sh`.
set -euo pipefail
R=$(cd "$(dirname "$0")/../.." && pwd)   # the repository
T=${TOOLS:-$R/../shared/gpu/tools}; V=${PAYLOAD_DIR:-$R/.gpu/vllm-0.26}; B=${BUILD:-/tmp/v26/vbuild}
PY=${PY312:-/tmp/py312/bin/python}
VER=0.26.0
export PTXAS=${PTXAS:-$($PY -c 'import triton, os; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))')}
mkdir -p "$B/dl" "$B/wheels" "$B/stage"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 28 27 26 24 31 17 5; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps $PLAT -d "$B/dl" vllm==$VER
# 0.23's list at the versions pip resolves for vllm==0.26.0; gguf dropped (0.26 no longer requires or imports it)
python3 -m pip download -q --no-deps $PLAT -d "$B/wheels" \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==8.0.2 \
  openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1 truststore==0.10.5 \
  openai-harmony==0.0.8 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 fastapi==0.136.3 starlette==1.10.0 \
  llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 setproctitle==1.3.8 blake3==1.0.11
# vLLM: stored zip, fatbin entries unusable on sm_90 blanked; FA2, Rust frontend, deep_gemm for other Pythons dropped;
# new in 0.26: vllm/third_party/fmha_sm100 (SM100-only sparse FMHA, lazily imported by MiniMax-M3 on Blackwell) dropped.
$PY "$T/repack.py" "$B"/dl/vllm-$VER-*.whl "$B/stage/$(basename "$B"/dl/vllm-$VER-*.whl)" --strip-fatbin \
  --drop 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' --drop 'vllm/vllm-rs' \
  --drop 'vllm/third_party/deep_gemm/_C.cpython-310-*' --drop 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
  --drop 'vllm/third_party/deep_gemm/_C.cpython-313-*' --drop 'vllm/third_party/deep_gemm/_C.cpython-314-*' \
  --drop 'vllm/third_party/fmha_sm100/*' > "$B/repack_vllm.log"
cat "$B/repack_vllm.log" | grep -v '^dropped vllm/third_party/fmha_sm100/'; echo "dropped $(grep -c fmha_sm100 "$B/repack_vllm.log") fmha_sm100 files"
for w in "$B"/wheels/*.whl; do
  b=$(basename "$w")
  case $b in xgrammar*) $PY "$T/repack.py" "$w" "$B/stage/$b" --drop 'xgrammar/lib/*' ;;  # static lib for C++ users
             *) $PY "$T/repack.py" "$w" "$B/stage/$b" ;; esac
done
ls -la "$B/stage"
tar -C "$B/stage" --transform 's,^,wheels/,' -cf - $(cd "$B/stage" && ls) \
  | xz --x86 --lzma2=preset=9e,dict=256MiB -T1 > "$B/payload.tar.xz"
# bin/: 0.23's scripts, with what differs for 0.26: a staging folder of its own (0.23's parts share these file names),
# and the extensions kernels_check imports (0.26 moved _C and _moe_C into *_stable_libtorch).
mkdir -p "$V/bin" "$V/payload"; cp "$T"/../vllm-0.23/bin/{install.sh,smoke.py,kernels_check.py} "$V/bin/"
sed -i -e 's/vllm-0\.23/vllm-0.26/g; s/vLLM 0\.23\.0/vLLM 0.26.0/' \
  -e 's#^STAGE=${VLLMGPU_STAGE:-/tmp/vllmgpu/parts}#STAGE=${VLLMGPU_STAGE:-/tmp/vllmgpu/parts-0.26}#' "$V/bin/install.sh"
sed -i 's/\["vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C",/["vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch",/' \
  "$V/bin/kernels_check.py"
grep -q 'parts-0.26' "$V/bin/install.sh" && grep -q '_moe_C_stable_libtorch' "$V/bin/kernels_check.py"
rm -f "$V"/payload/* "$V"/payload2/* "$B"/payload.tar.xz.part-*
split -b 60M -a 2 "$B/payload.tar.xz" "$B/payload.tar.xz.part-"
N=$(ls "$B"/payload.tar.xz.part-* | wc -l)
mv "$B/payload.tar.xz.part-aa" "$V/payload/"
if [ -f "$B/payload.tar.xz.part-ab" ]; then mkdir -p "$V/payload2"; mv "$B/payload.tar.xz.part-ab" "$V/payload2/"; fi
echo "payload.tar.xz $(sha256sum "$B/payload.tar.xz" | cut -d' ' -f1) $N" > "$V/bin/MANIFEST"
cat "$V/bin/MANIFEST"

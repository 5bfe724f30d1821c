#!/bin/bash
# Reassemble and install the carried vLLM payload on the offline GPU machine.
#
#   bash vllm-0.26/bin/install.sh stage     # only copy the parts found in folders that travelled with the command to $STAGE
#   bash vllm-0.26/bin/install.sh           # stage, then install every payload whose parts are all there
#
# Parts live in any carried folder vllm-0.26/*/ as <payload>.part-XX; parts sent by earlier commands
# on the same machine wait in $STAGE. MANIFEST (next to this script) lists each payload's
# sha256 and number of parts. Payloads:
#   payload.tar.xz   wheels/: vLLM 0.26.0 (trimmed for sm_90) + the missing pure-Python/small deps
#   fatbins.tar.xz   the untouched vLLM CUDA extensions (fallback; not built for 0.26, MANIFEST lists only payload.tar.xz)
# Wheels go to $SITE with pip --target (no index, no deps, no compile); use PYTHONPATH=$SITE.
# A dependency wheel is skipped when the machine already has that distribution at the same or a
# newer version, so nothing already installed there is shadowed by an older copy.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)     # the vllm-0.26 folder
STAGE=${VLLMGPU_STAGE:-/tmp/vllmgpu/parts-0.26}   # per version: 0.23 parts share these file names
WORK=${VLLMGPU_WORK:-/tmp/vllmgpu/work}
SITE=${VLLMGPU_SITE:-/tmp/site}
MODE=${1:-install}
PY=${PYTHON:-python3}
mkdir -p "$STAGE" "$WORK" "$SITE"
t0=$(date +%s)

# 1. stage every part that travelled with this call
shopt -s nullglob
for f in "$HERE"/*/*.part-*; do
  cp -f "$f" "$STAGE/"
  echo "[install] staged $(basename "$f") ($(stat -c %s "$f") bytes)"
done
[ "$MODE" = stage ] && { echo "[install] staged parts: $(ls "$STAGE" | tr '\n' ' ')"; exit 0; }

complete() {  # payload name -> 0 if all its parts are staged and the sha256 matches
  local name=$1 sha n have
  read -r sha n < <(awk -v p="$name" '$1==p {print $2, $3}' "$HERE/bin/MANIFEST")
  have=$(compgen -G "$STAGE/$name.part-*" | wc -l)
  if [ "$have" != "$n" ]; then echo "[install] $name: $have of $n parts staged"; return 1; fi
  if [ "$(cat "$STAGE"/"$name".part-* | sha256sum | cut -d' ' -f1)" != "$sha" ]; then
    echo "[install] $name: sha256 mismatch"; return 2; fi
  return 0
}

unpack() {  # payload name, destination
  mkdir -p "$2"
  if command -v xz >/dev/null; then
    cat "$STAGE"/"$1".part-* | xz -dc | tar -x -C "$2"
  else
    cat "$STAGE"/"$1".part-* | "$PY" -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1])' "$2"
  fi
}

# 2. main payload: the wheels (skipped when this machine already installed this very payload)
MAIN_SHA=$(awk '$1=="payload.tar.xz" {print $2}' "$HERE/bin/MANIFEST")
if [ -f "$SITE/.vllmgpu_payload" ] && [ "$(cat "$SITE/.vllmgpu_payload")" = "$MAIN_SHA" ]; then
  echo "[install] payload.tar.xz already installed in $SITE"
elif complete payload.tar.xz; then
  rm -rf "$WORK/wheels"; unpack payload.tar.xz "$WORK"
  echo "[install] unpacked $(ls "$WORK/wheels" | wc -l) wheels in $(( $(date +%s) - t0 )) s"
  # choose: vllm always; another wheel only if the machine lacks it or has an older version
  mapfile -t WHEELS < <(env -u PYTHONPATH "$PY" - "$WORK/wheels" <<'EOF'
import sys, os, importlib.metadata as md
from packaging.version import Version
from packaging.utils import parse_wheel_filename
d = sys.argv[1]
for f in sorted(os.listdir(d)):
    name, ver, _, _ = parse_wheel_filename(f)
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if name == "vllm" or have is None or Version(have) < ver:
        print(os.path.join(d, f))
        print(f"[install] take {name} {ver} (machine has {have})", file=sys.stderr)
    else:
        print(f"[install] skip {name} {ver} (machine has {have})", file=sys.stderr)
EOF
)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}"
  echo "[install] pip installed ${#WHEELS[@]} wheels into $SITE in $(( $(date +%s) - t0 )) s"
  rm -rf "$WORK/wheels"
  echo "$MAIN_SHA" > "$SITE/.vllmgpu_payload"
fi

# 2b. loose extra wheels carried in any vllm-0.26/*/ folder (fixes found later), installed as they are
EXTRA=("$HERE"/*/*.whl)
if [ ${#EXTRA[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${EXTRA[@]}"
  echo "[install] extra wheels: ${EXTRA[*]##*/}"
fi

# 3. optional fallback: the untouched CUDA extensions, copied over the blanked ones
if [ -d "$SITE/vllm" ] && [ ! -f "$SITE/.vllmgpu_fatbins" ] && compgen -G "$STAGE/fatbins.tar.xz.part-*" >/dev/null \
   && complete fatbins.tar.xz; then
  rm -rf "$WORK/fatbins"; unpack fatbins.tar.xz "$WORK/fatbins"
  (cd "$WORK/fatbins" && find . -name '*.so' -print0 | while IFS= read -r -d '' so; do
     cp -f "$so" "$SITE/$so"; echo "[install] restored full fatbin $so"; done)
  rm -rf "$WORK/fatbins"
fi

# 4. report
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import time, importlib
t = time.time()
import torch, vllm, transformers
print(f"[install] import vllm {vllm.__version__} from {vllm.__file__} in {time.time()-t:.1f} s; "
      f"torch {torch.__version__} cuda {torch.version.cuda}; transformers {transformers.__version__}")
EOF
echo "[install] done in $(( $(date +%s) - t0 )) s; use: export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"

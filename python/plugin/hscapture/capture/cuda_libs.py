"""Makes the CUDA libraries hscapture's Rust core opens by name (NVRTC) findable.

The core loads CUDA dynamically (cudarc): ``libcuda`` comes with the driver, but NVRTC often lives
only inside PyTorch's ``nvidia-*`` wheels, outside the loader's search path. Loading it here by full
path (``RTLD_GLOBAL``) lets the core's ``dlopen("libnvrtc.so.<major>")`` find it by soname.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_loaded: list[str] = []


def _candidates() -> list[str]:
    dirs = []
    for p in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib", "nvidia/cu12/lib"):
            d = os.path.join(p, sub)
            if os.path.isdir(d):
                dirs.append(d)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
    out = []
    for d in dirs:
        # builtins first: NVRTC opens them by name when it compiles
        out += sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*"))) + sorted(
            glob.glob(os.path.join(d, "libnvrtc.so*"))
        )
    return out


def preload_nvrtc() -> list[str]:
    """Loads NVRTC (and its builtins) globally; returns the files loaded (empty if none was found)."""
    if _loaded:
        return list(_loaded)
    seen_nvrtc = False
    for path in _candidates():
        is_builtins = "builtins" in os.path.basename(path)
        if not is_builtins and seen_nvrtc:
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded.append(path)
        seen_nvrtc = seen_nvrtc or not is_builtins
    return list(_loaded)

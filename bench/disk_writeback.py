"""How a disk takes sample-sized files from many writer threads, side by side in one run: no sync (the KV
connector's default: the page cache writes back), fsync per file (the offline writer's default), and
`sync_file_range` after each file (writeback started, not waited for).

    python3 bench/disk_writeback.py --dir /var/tmp/wb --modes none,fsync,sfr,none --files 120 --threads 16

Each file is one DeepSeek-V3-shape sample (1,024 tokens × 4 layers × 7,168 × bf16 = 58.7 MB), written to a hidden
name and renamed into place as hscapture's writer does. Prints, per mode, GB/s until the last file is in place and
until everything is on disk (after `sync`). Needs files × 58.7 MB free under --dir; removes what it wrote.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import threading
import time

SAMPLE = 58_720_256
CHUNK = 8 << 20
SYNC_FILE_RANGE_WRITE = 2


def write_all(root: str, mode: str, files: int, threads: int, data: bytes) -> tuple[float, float]:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    todo, lock = list(range(files)), threading.Lock()

    def one(i: int) -> None:
        tmp = os.path.join(root, f".{i}.partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view, off = memoryview(data), 0
            while off < len(data):
                off += os.pwrite(fd, view[off : off + CHUNK], off)
            if mode == "fsync":
                os.fsync(fd)
            elif mode == "sfr":
                libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(root, f"{i}.safetensors"))

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            one(i)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    placed = time.perf_counter() - t0
    os.sync()
    return placed, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/hscapture-writeback")
    ap.add_argument("--modes", default="none,fsync,sfr,none")
    ap.add_argument("--files", type=int, default=120)
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    unknown = set(args.modes.split(",")) - {"none", "fsync", "sfr"}
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}: expected none, fsync or sfr")
    data = os.urandom(1 << 22) * (SAMPLE // (1 << 22))
    gb = args.files * len(data) / 1e9
    for mode in args.modes.split(","):
        root = os.path.join(args.dir, mode)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        os.sync()
        try:
            placed, synced = write_all(root, mode, args.files, args.threads, data)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(f"{mode:6s} {gb / placed:5.2f} GB/s until the last file is in place, {gb / synced:5.2f} until on disk")


if __name__ == "__main__":
    main()

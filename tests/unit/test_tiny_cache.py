"""The tiny-model cache is shared by test processes that run side by side (scripts/test.sh's lanes)."""

from __future__ import annotations

import json
import subprocess
import sys

_BUILD = "import sys; from hscapture.testing import tiny; print(tiny.build('llama', sys.argv[1]))"


def test_processes_building_one_model_at_once_leave_one_whole_copy(tmp_path):
    path = tmp_path / "tiny-llama"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(path)}
    assert json.loads((path / "hscapture_tiny.json").read_text())["kind"] == "llama"
    assert (path / "model.safetensors").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir() if ".part-" in p.name] == [], "no half-built folder is left behind"

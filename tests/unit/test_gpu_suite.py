"""The GPU suite (``tests/gpu``) never runs in CI: it skips without CUDA. These checks keep it honest here: every
``hscapture`` name it imports — at the top of a module or inside a test function, where collection does not look —
still exists, so a moved module fails CI instead of the next session on the H200."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "gpu"


def _hscapture_imports(folder: Path) -> list[tuple[str, int, str, str | None]]:
    """(file, line, module, name or None) of every absolute ``hscapture`` import in ``folder``'s modules."""
    found = []
    for f in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "hscapture":
                found += [(f.name, node.lineno, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    (f.name, node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "hscapture"
                ]
    return found


def _unresolved(found: list[tuple[str, int, str, str | None]]) -> list[str]:
    missing = []
    for file, line, module, name in found:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{file}:{line}: import {module}: {e}")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{file}:{line}: {module} has no {name}")
    return missing


def test_the_gpu_suite_imports_hscapture_names():
    found = _hscapture_imports(GPU)
    assert len(found) >= 10, f"the GPU suite's imports were not found ({len(found)}): is {GPU} still there?"
    missing = _unresolved(found)
    assert not missing, "tests/gpu imports names that no longer exist:\n" + "\n".join(missing)


def test_the_check_sees_a_name_inside_a_function_that_moved(tmp_path):
    """As `hscapture.reference` did (to `hscapture.testing`): collection passes, the test would fail on the GPU."""
    (tmp_path / "test_x.py").write_text("def test():\n    from hscapture import load_sample, reference\n")
    found = _hscapture_imports(tmp_path)
    assert [n for *_, n in found] == ["load_sample", "reference"]
    assert _unresolved(found) == ["test_x.py:2: hscapture has no reference"]

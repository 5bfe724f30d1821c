"""The Python package's imports, read from its source (deferred imports too, which only some paths run: the CUDA
path, pipeline stages, the object store):
- no import circle: a circle broken only by deferring an import is a design knot (two modules that each need the
  other), and it breaks as soon as someone moves the import up;
- every import of the package's own modules names a module that exists and a name that module defines, so that a
  moved module cannot leave an import behind on a path the CPU tests never run."""

from __future__ import annotations

import ast
from pathlib import Path

import hscapture


def modules(root: Path, package: str) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join([package, *parts])] = path
    return found


def target_of(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` in module `name` reads from."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(name: str, path: Path, known: set[str], package: str) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its body (a name imported from a package that is
    itself a module counts as that module)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = target_of(name, is_package, node)
            candidates = [f"{target}.{a.name}" for a in node.names] or [target]
            candidates = [c if c in known else target for c in candidates]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            if not (c == package or c.startswith(package + ".")):
                continue
            while c not in known and "." in c:
                c = c.rsplit(".", 1)[0]
            if c in known and c != name and not name.startswith(c + "."):  # a submodule's parent package runs first
                out.add(c)
    return out


def circles(root: Path, package: str) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    mods = modules(root, package)
    graph = {m: imports(m, p, set(mods), package) for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    return found


def defined(path: Path) -> set[str]:
    """The names a module binds at its top level."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved(root: Path, package: str, native: object) -> list[str]:
    """`module: from X import name` for each import of the package's own modules that names nothing."""
    mods = modules(root, package)
    bad = []
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = target_of(name, is_package, node)
            if not (target == package or target.startswith(package + ".")):
                continue
            for a in node.names:
                if f"{target}.{a.name}" in mods or a.name == "*":
                    continue
                if target == f"{package}._native":
                    ok = hasattr(native, a.name)
                elif target == package and a.name == "_native":
                    ok = True
                else:
                    ok = target in mods and a.name in defined(mods[target])
                if not ok:
                    bad.append(f"{name}: from {target} import {a.name}")
    return bad


def test_every_import_of_the_package_resolves():
    root = Path(hscapture.__file__).parent
    assert unresolved(root, "hscapture", hscapture._native) == []


def test_a_moved_module_left_behind_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\ndef f():\n    from .gone import y\n    from .a import Z\n")
    assert unresolved(pkg, "pkg", object()) == ["pkg.a: from pkg.gone import y", "pkg.a: from pkg.a import Z"]


def test_the_package_has_no_import_circle():
    root = Path(hscapture.__file__).parent
    assert len(modules(root, "hscapture")) > 20
    assert circles(root, "hscapture") == []


def test_a_circle_through_a_deferred_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert circles(pkg, "pkg") == [["pkg.a", "pkg.sub.b"]]

"""Checks the import rules on the package as it installs: the layers (pyproject's [tool.importlinter])
and that no module imports itself through a chain of imports (docs/architecture.md).

The services' folders are mapped into the ``kvmesh`` namespace by pyproject's package-dir, which
import-linter cannot follow in the source tree. So this lays the package out as a wheel would
(setuptools ``build_py`` into a temp dir) and runs ``lint-imports`` and the cycle check on that copy.
The cycle check counts every import: at module level, under ``TYPE_CHECKING`` and inside functions.

Run: .venv/bin/python scripts/lint_imports.py  (part of `make lint`)
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_graph(root: Path, package: str = "kvmesh") -> dict[str, set[str]]:
    """Every module of ``package`` under ``root`` -> the modules of the package it imports, wherever in
    the file (``from a import b`` names the module ``a.b`` when there is one, else ``a``)."""
    modules: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*here[:len(here) - node.level + 1], *([node.module] if node.module else [])]) \
                    if node.level else node.module or ""
                deps.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that reach each other through imports (Tarjan's strongly connected
    components of more than one module), as one cycle through the group, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_one_cycle(graph, set(group)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _one_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest chain of imports from the group's first module back to itself, within the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def check_cycles(root: Path) -> int:
    found = cycles(import_graph(root))
    for cycle in found:
        sys.stderr.write("import cycle: " + " -> ".join(cycle) + "\n")
    print(f"import cycles (TYPE_CHECKING and function-level imports included): {len(found)}")
    return 1 if found else 0


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-lint-") as staged:
        build = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", "import setuptools; setuptools.setup()", "-q",
             "build_py", "--build-lib", staged],
            cwd=ROOT, capture_output=True, text=True,
        )
        if build.returncode != 0:
            sys.stderr.write(build.stdout + build.stderr)
            return build.returncode
        env = {**os.environ, "PYTHONPATH": staged}
        lint = Path(sys.executable).with_name("lint-imports")
        layers = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=staged, env=env).returncode
        return layers or check_cycles(Path(staged))


if __name__ == "__main__":
    sys.exit(main())

"""`make lint`'s cycle check (scripts/lint_imports.py) on small packages: every kind of import counts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "scripts" / "lint_imports.py")
lint_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint_imports)


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"pkg/__init__.py": "", "pkg/sub/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_type_checking_import_and_a_function_level_import_close_a_cycle(tmp_path):
    root = package(tmp_path, {
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\n",
        "pkg/sub/b.py": "def f():\n    from pkg import a\n    return a\n",
        "pkg/c.py": "import pkg.a\nfrom pkg.sub import b\n",
    })
    graph = lint_imports.import_graph(root, "pkg")
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub.b"}  # `from pkg.sub import b` names the module pkg.sub.b
    assert lint_imports.cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_relative_imports_resolve_and_a_chain_without_a_way_back_is_no_cycle(tmp_path):
    root = package(tmp_path, {"pkg/sub/x.py": "from . import y\nfrom ..c import C\n", "pkg/sub/y.py": "",
                              "pkg/c.py": "from pkg.sub import y\n"})
    graph = lint_imports.import_graph(root, "pkg")
    assert graph["pkg.sub.x"] == {"pkg.sub.y", "pkg.c"}
    assert lint_imports.cycles(graph) == []

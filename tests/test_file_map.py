"""The README's file map is the one map of the tree: every package folder has its row, every row a folder."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = ("kvmesh", "router", "kv_service", "model_worker", "kernels", "bridge")
"""The folders pyproject maps into the ``kvmesh`` namespace (its package-dir)."""


def mapped_folders() -> list[str]:
    """The first column of the README's "The file map" table, as folder paths without the slash."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## The file map\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1).rstrip("/") for m in re.finditer(r"^\| `([^`]+/)` \|", section, re.M)]


def package_folders() -> set[str]:
    """Every folder of the installed package: those with an ``__init__.py``, and the data folders
    the wheel carries (pyproject's package-data)."""
    found = {p.parent.relative_to(ROOT).as_posix() for r in ROOTS for p in (ROOT / r).rglob("__init__.py")
             if "__pycache__" not in p.parts}
    return found | {"kv_service/lua", "kvmesh/data"}


def test_every_package_folder_has_a_row_in_the_file_map():
    missing = sorted(package_folders() - set(mapped_folders()))
    assert not missing, f"package folders missing from the README's file map (add a row): {missing}"


def test_every_row_of_the_file_map_is_a_folder_and_none_twice():
    rows = mapped_folders()
    assert len(rows) == len(set(rows)), f"a folder with two rows: {sorted(r for r in rows if rows.count(r) > 1)}"
    gone = [r for r in rows if not (ROOT / r).is_dir()]
    assert not gone, f"rows of the README's file map for folders that do not exist: {gone}"

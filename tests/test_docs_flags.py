"""Every flag of every `kvmesh` command is documented somewhere in docs/ or the README."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvmesh.cli import COMMAND_MODULES, build_parser

ROOT = Path(__file__).resolve().parents[1]


def flags(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags(sub, (*path, name))
        else:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    yield " ".join(path), option


@pytest.mark.parametrize("command", list(COMMAND_MODULES))
def test_every_flag_is_in_the_docs(command):
    docs = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    missing = [f"kvmesh {where} {option}" for where, option in flags(build_parser(only=command))
               if where.split(" ")[0] == command and not re.search(re.escape(option) + r"(?![\w-])", docs)]
    assert not missing, f"undocumented flags (add them to docs/): {missing}"

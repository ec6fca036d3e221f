"""How a config field tells the CLI about its flag (kvmesh/commands/config_args.py derives the flags).

Every service's config dataclass is the one definition of its settings: the flag's name, type,
default and help come from the field and the docstring under it. ``flag()`` is only needed where
the flag's name is not the field's name, or its value needs a placeholder in --help. A field whose
type is itself a config dataclass (a group of settings shared by several commands: the router's
and the simulator's routing settings) contributes its fields' flags, flat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FLAG = "flag"
"""Field metadata key: the flag's name (without ``--``) where it is not the field's name."""
METAVAR = "metavar"
"""Field metadata key: the value's placeholder in --help."""
NO_FLAG = "no_flag"
"""Field metadata key: the field has no flag (set by code: a clock, a callback)."""
OLD_NAMES = "old_names"
"""Field metadata key: earlier names of the flag, still taken for one release (each use warns)."""


def flag(default: Any = dataclasses.MISSING, *, name: str | None = None, metavar: str | None = None,
         default_factory: Any = dataclasses.MISSING, old_names: tuple[str, ...] = ()) -> Any:
    """A dataclass field whose flag is ``--name`` (default: the field's name) shown with ``metavar``;
    ``old_names``: the flag's earlier spellings (without ``--``), deprecated aliases for one release."""
    metadata = {k: v for k, v in ((FLAG, name), (METAVAR, metavar), (OLD_NAMES, old_names or None)) if v is not None}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def code_only(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field set by code, never by a flag (a clock, a callback)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={NO_FLAG: True})

"""How a config field tells the CLI about its flag (kvmesh/commands/config_args.py derives the flags).

Every service's config dataclass is the one definition of its settings: the flag's name, type,
default and help come from the field and the docstring under it. ``flag()`` is only needed where
the flag's name is not the field's name, or its value needs a placeholder in --help.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FLAG = "flag"
"""Field metadata key: the flag's name (without ``--``) where it is not the field's name."""
METAVAR = "metavar"
"""Field metadata key: the value's placeholder in --help."""


def flag(default: Any = dataclasses.MISSING, *, name: str | None = None, metavar: str | None = None,
         default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose flag is ``--name`` (default: the field's name) shown with ``metavar``."""
    metadata = {k: v for k, v in ((FLAG, name), (METAVAR, metavar)) if v is not None}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)

"""CLI flags derived from the config dataclasses, so a setting is written once: as a field.

The flag's name, type, default and help come from the field (vLLM's ``EngineArgs`` does the same
from ``fields()``): ``--field-name`` (or the name given by ``kvmesh.contract.settings.flag`` where
a flag kept an older name), its annotation, its default and the docstring under it. A field without a docstring
is an error at start-up: the docstring is the flag's help.

Types: ``int``, ``float``, ``str``, ``bool`` (default False: ``--flag`` sets it; default True:
``--no-flag`` clears it; ``bool | None``: ``--flag`` / ``--no-flag``, neither = None) and ``list[str]`` / ``list[int]`` (comma-separated). An optional field
(``X | None``) also takes ``none`` (or an empty value) for None. A field whose type is a dataclass
is a group: its fields become flags (flat, their defaults those of the group's default), and
``config_from_args`` builds it back. A field made with ``code_only()`` gets no flag. A flag renamed
keeps its old spelling for one release (``flag(old_names=...)``): taken, said so in --help, and
warned about on stderr when used.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from typing import Any

from kvmesh.contract.settings import FLAG, METAVAR, NO_FLAG, OLD_NAMES


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls`` (and its dataclass bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get(FLAG) or f.name.replace("_", "-")


class _OldNameAction(argparse._StoreAction):
    """Stores the value as the flag's own action would, and warns when it came by an old name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            print(f"kvmesh: {option_string} is deprecated (removed in the next release): use {self.option_strings[0]}",
                  file=sys.stderr)
        super().__call__(parser, namespace, values, option_string)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(type without None, whether None is allowed)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp}")
        return args[0], True
    return tp, False


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _shown(value: Any) -> str:
    if value is None or value == []:
        return "none"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _parser_of(tp: Any, optional: bool, name: str) -> Callable[[str], Any]:
    if typing.get_origin(tp) is list:
        (elem,) = typing.get_args(tp)
        one = _parser_of(elem, False, name)

        def parse_list(raw: str) -> list:
            return [one(x.strip()) for x in raw.split(",") if x.strip()]

        return parse_list
    if tp not in (int, float, str):
        raise TypeError(f"--{name}: unsupported type {tp}")

    def parse(raw: str) -> Any:
        if optional and raw.strip().lower() in ("", "none"):
            return None
        return tp(raw)

    parse.__name__ = tp.__name__  # argparse names the type in its error message
    return parse


def _group_type(hints: dict[str, Any], f: dataclasses.Field) -> type | None:
    tp, _ = _unwrap(hints[f.name])
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def add_config_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
                    exclude: Iterable[str] = (), prefix: str = "",
                    choices: Mapping[str, Iterable[Any]] | None = None, defaults: Any = None) -> None:
    """Adds one flag per field of the dataclass ``cls`` (a group's fields flat).

    Args:
        exclude: fields that get no flag (set by the command itself); a group's field as
            ``group.field`` (``routing.policy``).
        prefix: put before every flag name and ``dest`` (e.g. ``"sim-"`` -> ``--sim-step-overhead``).
        choices: allowed values per field name.
        defaults: an instance whose values are the flags' defaults (a group's default); None = the
            fields' own defaults.
    """
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    choices = choices or {}
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init or f.metadata.get(NO_FLAG):
            continue
        group = _group_type(hints, f)
        if group is not None:
            inner = getattr(defaults, f.name) if defaults is not None else _default_of(f)
            add_config_args(p, group, exclude=_within(skip, f.name), prefix=prefix, choices=choices, defaults=inner)
            continue
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring: it is the help of its flag")
        tp, optional = _unwrap(hints[f.name])
        default = getattr(defaults, f.name) if defaults is not None else _default_of(f)
        name = prefix + flag_name(f)
        dest = prefix.replace("-", "_") + f.name
        kwargs: dict[str, Any] = {"dest": dest}
        if default is dataclasses.MISSING:
            kwargs["required"] = True
            shown = ""
        else:
            kwargs["default"] = default
            shown = f" (default {_shown(default)})"
        if tp is bool and optional:
            # NOTE: an optional bool is a choice with a default left to the code (e.g. per device):
            # --flag sets True, --no-flag False, neither keeps None.
            kwargs["action"] = argparse.BooleanOptionalAction
            shown = ""
        elif tp is bool:
            if default is True:
                name = name if name.startswith("no-") else f"no-{name}"
                kwargs["action"] = "store_false"
                shown = " (on by default; this flag turns it off)"
            else:
                kwargs["action"] = "store_true"
                shown = ""
        else:
            kwargs["type"] = _parser_of(tp, optional, name)
            if f.name in choices:
                kwargs["choices"] = list(choices[f.name])
            if f.name not in choices:
                kwargs["metavar"] = f.metadata.get(METAVAR) or name.upper().replace("-", "_")
        old = [prefix + o for o in f.metadata.get(OLD_NAMES, ())]
        if old:
            assert "action" not in kwargs, f"--{name}: old names are for flags that take a value"
            kwargs["action"] = _OldNameAction
            shown += f" ({', '.join('--' + o for o in old)}: the old name, deprecated, removed in the next release)"
        kwargs["help"] = docs[f.name].replace("%", "%%") + shown
        p.add_argument(f"--{name}", *(f"--{o}" for o in old), **kwargs)


def _within(exclude: set[str], group: str) -> set[str]:
    """The entries of ``exclude`` that name fields of ``group`` (``group.x`` -> ``x``)."""
    return {e[len(group) + 1:] for e in exclude if e.startswith(group + ".")}


def config_from_args(cls: type, args: argparse.Namespace, *, prefix: str = "", exclude: Iterable[str] = (),
                     **overrides: Any) -> Any:
    """Builds ``cls`` from the flags ``add_config_args`` added (groups too; ``exclude`` as given
    there: those fields keep their defaults); ``overrides`` win."""
    dest = prefix.replace("-", "_")
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in overrides or f.name in skip or f.metadata.get(NO_FLAG):
            continue
        group = _group_type(hints, f)
        if group is not None:
            values[f.name] = config_from_args(group, args, prefix=prefix, exclude=_within(skip, f.name))
        elif hasattr(args, dest + f.name):
            values[f.name] = getattr(args, dest + f.name)
    return cls(**(values | overrides))

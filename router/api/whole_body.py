"""A small body that arrived whole (one ASGI message, one ext_proc body message: most requests), read by
``json.loads`` and walked once against the bounds the streaming parser counts (router/api/request_body.py's
module docstring says when, and why the answers are the same).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvmesh.contract.limits import MAX_STOP_TOKEN_IDS
from kvmesh.router.api.body_bounds import (
    MAX_OBJECT_KEYS,
    MAX_OTHER_VALUES,
    WHOLE_DEPTH,
    YAJL_INT_BOUND,
    BodyBounds,
)
from kvmesh.router.text.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS


class _Unsure(Exception):
    """The whole-body walk cannot vouch for the document: the streaming parser reads it."""


def _no_constant(_name: str) -> Any:
    raise _Unsure  # NaN, Infinity: JSON has none (yajl refuses them)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _Unsure  # NOTE: the builder counts a repeated key twice against a bound; json.loads keeps one
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def parse_whole(data: bytes, bounds: BodyBounds) -> dict[str, Any] | None:
    """The object a :class:`BodyParser` builds from ``data`` (a whole body), read by ``json.loads``,
    when that is certainly the same object and within every bound; None when it may not be (the
    streaming parser then decides, with its own answer or error)."""
    if not data or (bounds.max_token_bytes and len(data) > bounds.max_token_bytes):
        return None
    if b"\\u" in data and (b"\\ud" in data or b"\\uD" in data):
        return None  # NOTE: an escaped surrogate: json.loads keeps a lone one where yajl writes "?"
    try:
        obj = _DECODER.decode(data.decode("utf-8"))
    except (_Unsure, ValueError, RecursionError):
        return None
    if type(obj) is not dict:
        return None
    try:
        _Walk(bounds).root(obj)
    except _Unsure:
        return None
    return obj


class _Walk:
    """The bounds the builder counts (BodyParser._place), checked over a finished object; raises
    _Unsure at anything at or past a bound, or anything the builder would count differently."""

    def __init__(self, bounds: BodyBounds) -> None:
        self.bounds = bounds
        self.other = 0

    def root(self, obj: dict[str, Any]) -> None:
        for key, value in obj.items():
            if type(value) is not list:
                if key == "stop" and type(value) is str:
                    self.stop(value)
                self.count(value, 1)
            elif key == "messages":
                self.messages(value)
            elif key == "prompt":
                self.prompt(value)
            elif key == "stop":
                if len(value) > MAX_STOP_STRINGS:
                    raise _Unsure
                for s in value:
                    if type(s) is not str:
                        raise _Unsure
                    self.stop(s)
            elif key == "stop_token_ids":
                if len(value) > MAX_STOP_TOKEN_IDS:
                    raise _Unsure
                self.ids(value, MAX_STOP_TOKEN_IDS)
            else:
                self.count(value, 1)
        if self.other > MAX_OTHER_VALUES:
            raise _Unsure

    def messages(self, messages: list[Any]) -> None:
        if len(messages) > self.bounds.max_messages:
            raise _Unsure
        parts = 0
        for m in messages:
            if type(m) is not dict or len(m) > MAX_OBJECT_KEYS:
                raise _Unsure
            for key, value in m.items():
                if key == "content" and type(value) is list:
                    parts += len(value)
                    if parts > self.bounds.max_content_parts:
                        raise _Unsure
                    for part in value:
                        if type(part) is not dict or len(part) > MAX_OBJECT_KEYS:
                            raise _Unsure
                        for v in part.values():
                            self.scalar(v)
                else:
                    self.scalar(value)

    def prompt(self, prompt: list[Any]) -> None:
        if prompt and type(prompt[0]) in (list, str):
            if len(prompt) != 1:
                raise _Unsure  # several prompts: the builder's refusal, or a mix
            if type(prompt[0]) is list:
                self.ids(prompt[0], self.bounds.max_prompt_ids)
            return
        self.ids(prompt, self.bounds.max_prompt_ids)

    @staticmethod
    def ids(ids: list[Any], limit: int) -> None:
        """Token ids (0 = no bound on their count)."""
        if not ids:
            return
        if limit and len(ids) > limit:
            raise _Unsure
        try:
            # NOTE: two passes in C; a string, null or container among the numbers makes them raise.
            # Floats and booleans go in as the builder puts them (the models judge them later).
            ok = min(ids) > -YAJL_INT_BOUND and max(ids) < YAJL_INT_BOUND
        except TypeError:
            ok = False
        if not ok:
            raise _Unsure

    @staticmethod
    def stop(s: str) -> None:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise _Unsure

    def scalar(self, v: Any) -> None:
        """A field of a message or content part: counted as a key by the builder, never as a value."""
        if type(v) in (dict, list):
            raise _Unsure
        self.number(v)

    def count(self, v: Any, depth: int) -> None:
        """``v`` and everything in it, each one JSON value outside messages, prompt and stop."""
        self.other += 1
        t = type(v)
        if t is dict or t is list:
            if depth >= WHOLE_DEPTH:
                raise _Unsure
            for x in (v.values() if t is dict else v):
                self.count(x, depth + 1)
            if self.other > MAX_OTHER_VALUES:
                raise _Unsure
        else:
            self.number(v)

    @staticmethod
    def number(v: Any) -> None:
        t = type(v)
        if (t is int and not -YAJL_INT_BOUND < v < YAJL_INT_BOUND) or (t is float and not math.isfinite(v)):
            raise _Unsure

"""An OpenAI request body parsed as it arrives, refused at the first element past a bound.

Why not the web framework's body handling: it buffers the whole body (up to the byte limit), parses
it in one call on the event loop and only then validates. A million one-character messages (32 MB)
held the router's loop, HTTP and gRPC alike, for 6-10 s before any limit was looked at.

Here the body is fed, in slices of ``SLICE_BYTES``, to an incremental JSON parser (ijson's yajl2
C backend, which turns bytes into events); a small builder makes the object from the events and
counts every array as it grows:

- ``messages`` up to ``max_messages``, content parts (all messages together) up to
  ``max_content_parts``, fields per message or part up to ``MAX_OBJECT_KEYS``;
- ``stop`` up to MAX_STOP_STRINGS strings of 1-MAX_STOP_CHARS characters, ``stop_token_ids`` up to
  MAX_STOP_TOKEN_IDS, ``prompt`` up to ``max_prompt_ids`` token ids (the router's largest prompt
  bound) and one prompt;
- everything else (unknown fields, ``chat_template_kwargs``, ``tools``, ...) up to
  ``MAX_OTHER_VALUES`` JSON values in all, nested at most ``MAX_DEPTH`` deep.

The element past a bound refuses the request at once: the work a request costs is what the bounds
allow, never what was sent. The loop serves every other client between two slices. The byte limit
is counted on the same stream (a declared Content-Length over it is refused before reading).

**A small body that arrives whole** (one ASGI message, one ext_proc body message: most requests) is
read by ``json.loads`` instead (:func:`parse_whole`: a 4,096-id prompt's body cost 0.87 ms of CPU
against 2.26 ms through the slices on a loaded host, docs/epp.md), then walked once against the same
bounds. The walk only says "certainly
within every bound, and certainly what the builder would build"; anything it is not sure of (a bound
reached, a number or string yajl reads differently, a duplicate key, deep nesting, malformed JSON)
goes to the streaming parser, which gives the answer and the error it always gave. Such a body is
at most ``WHOLE_BYTES``, so nothing is refused later than it was: it had arrived whole already.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import ijson

from kvmesh.contract.errors import InvalidArgument, RequestTooLarge
from kvmesh.contract.limits import MAX_STOP_TOKEN_IDS
from kvmesh.router.api.body_bounds import (
    MAX_DEPTH,
    MAX_OBJECT_KEYS,
    MAX_OTHER_VALUES,
    WHOLE_BYTES,
    BodyBounds,
    BodyTooLarge,
)
from kvmesh.router.api.whole_body import parse_whole
from kvmesh.router.text.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS

try:
    _ijson = ijson.get_backend("yajl2_c")
except ImportError:  # pragma: no cover - ijson's wheels ship the C backend; the Python one is ~20x slower
    _ijson = ijson

SLICE_BYTES = 8 * 1024
"""Bytes parsed between two turns of the event loop (about a millisecond of the densest JSON)."""
MAX_SLICE_BYTES = 64 * 1024 * 1024
"""yajl re-reads a token that spans two slices from its start, so a long string fed in fixed slices
costs time quadratic in its length (30 MB: 7 s). A slice that yields no event (the parser is inside
one long token) makes the next one twice as large, up to this: the cost is linear again."""
# The kinds of container the builder tells apart; each decides how its elements are counted.
_ROOT, _MESSAGES, _MESSAGE, _PARTS, _PART, _STOP, _STOP_IDS, _PROMPT, _PROMPT_IDS, _OTHER = range(10)
_ROOT_ARRAYS = {"messages": _MESSAGES, "stop": _STOP, "stop_token_ids": _STOP_IDS, "prompt": _PROMPT}
_ID_ARRAYS = frozenset({_PROMPT, _PROMPT_IDS, _STOP_IDS})
"""Containers whose numbers are token ids, appended in runs (BodyParser._extend_ids)."""


class _Frame:
    """A container being built: its kind, the key its next value goes under (objects) or the
    elements so far (arrays), and where it sits (its path is only spelled out for an error)."""

    __slots__ = ("value", "kind", "key", "count", "parent", "slot")

    def __init__(self, value: Any, kind: int, parent: _Frame | None, slot: str | int | None) -> None:
        self.value = value
        self.kind = kind
        self.key: str | None = None
        self.count = 0
        self.parent = parent
        self.slot = slot

    def path(self) -> str:
        """The container's path as a parameter name: ``messages[3].content``."""
        if self.parent is None:
            return ""
        base = self.parent.path()
        if isinstance(self.slot, int):
            return f"{base}[{self.slot}]"
        return f"{base}.{self.slot}" if base else str(self.slot)


class BodyParser:
    """Push bytes with :meth:`feed`, get the object from :meth:`close`; raises InvalidArgument /
    RequestTooLarge (with ``param``) at the first element past a bound."""

    def __init__(self, bounds: BodyBounds) -> None:
        self.bounds = bounds
        self._whole: dict[str, Any] | None = None
        """The object :func:`parse_whole` read from a body fed whole; None: the streaming parser's."""
        self._fed = 0
        self._events = ijson.sendable_list()
        self._pending = bytearray()
        self._slice = SLICE_BYTES
        self._quiet = 0
        """Bytes parsed since the last event: the length of the token being read, give or take a slice."""
        self._coro = _ijson.basic_parse_coro(self._events, use_float=True)
        self._stack: list[_Frame] = []
        self._root: dict[str, Any] | None = None
        self._parts = 0
        self._other = 0
        self._prompts = 0

    @property
    def read_whole(self) -> bool:
        """The body was read whole by :func:`parse_whole` (not by the streaming parser)."""
        return self._whole is not None

    async def feed(self, data: bytes, last: bool = False) -> None:
        """Parses what ``data`` completes, slice by slice, giving the event loop a turn between two.
        ``last``: ``data`` ends the body; when it is also the first, a small body is read whole
        (:func:`parse_whole`)."""
        if last and not self._fed and len(data) <= WHOLE_BYTES:
            self._whole = parse_whole(data, self.bounds)
            if self._whole is not None:
                self._fed = len(data)
                return
        self._fed += len(data)
        self._pending += data
        turn = False
        while len(self._pending) >= self._slice:
            if turn:
                await asyncio.sleep(0)
            piece = bytes(self._pending[:self._slice])
            del self._pending[:self._slice]
            self._send(piece)
            turn = True

    def close(self) -> dict[str, Any]:
        """The whole object; raises InvalidArgument when the body ended early (or was empty)."""
        if self._whole is not None:
            return self._whole
        if self._pending:
            self._send(bytes(self._pending))
            self._pending.clear()
        if self._root is None and not self._stack:
            raise InvalidArgument("the request body is empty: send a JSON object")
        try:
            self._coro.close()
        except ijson.JSONError as exc:
            self._drain()
            self._malformed(exc)
        self._drain()
        assert self._root is not None
        return self._root

    def _send(self, data: bytes) -> None:
        try:
            self._coro.send(data)
        except ijson.JSONError as exc:
            self._drain()  # NOTE: the events before the error tell where it is
            self._malformed(exc)
        if self._events:
            self._slice, self._quiet = SLICE_BYTES, 0
            self._drain()
            return
        self._slice = min(2 * self._slice, MAX_SLICE_BYTES)
        self._quiet += len(data)
        limit = self.bounds.max_token_bytes
        if limit and self._quiet > limit + SLICE_BYTES:
            where = self._where()
            raise RequestTooLarge(f"{where or 'a value in the request body'} is over {limit} bytes of JSON, longer "
                                  "than any prompt this router accepts (--max-prompt-bytes)", param=where or None)

    def _malformed(self, exc: Exception) -> None:
        reason = str(exc).split("\n", 1)[0].removeprefix("parse error: ").removeprefix("lexical error: ")
        where = self._where()
        if "integer overflow" in reason:
            raise InvalidArgument(f"{where or 'a number'} is out of range: this API reads integers in [-2**63, 2**63) "
                                  "(and each field has its own range)", param=where or None)
        at = f" in {where}" if where else ""
        if "premature EOF" in reason:
            raise InvalidArgument(f"the request body is not valid JSON: it ends early{at}", param=where or None)
        raise InvalidArgument(f"the request body is not valid JSON: {reason}{at}", param=where or None)

    def _where(self) -> str:
        if not self._stack:
            return ""
        top = self._stack[-1]
        where = top.path()
        if isinstance(top.value, dict):
            return f"{where}.{top.key}".lstrip(".") if top.key is not None else where
        return f"{where}[{top.count}]"

    # -- the builder --------------------------------------------------------------------------------
    def _drain(self) -> None:
        events = self._events
        if not events:
            return
        stack, place = self._stack, self._place
        i, n = 0, len(events)
        while i < n:
            event, value = events[i]
            i += 1
            if event == "number" and stack and stack[-1].kind in _ID_ARRAYS:
                # NOTE: a run of ids (a 4k-token prompt is 4k events) goes in at once, bounded once:
                # one Python call per element cost ~3 ms a 4k-id body.
                j = i
                while j < n and events[j][0] == "number":
                    j += 1
                self._extend_ids(stack[-1], [value, *(v for _, v in events[i:j])])
                i = j
                continue
            if event == "map_key":
                self._key(value)
            elif event == "start_map":
                self._open({})
            elif event == "start_array":
                self._open([])
            elif event == "end_map" or event == "end_array":
                stack.pop()
            elif stack:
                place(value, False)
            else:
                raise InvalidArgument(f"the request body must be a JSON object ({{...}}), got {type(value).__name__}")
        del events[:]

    def _extend_ids(self, frame: _Frame, ids: list[Any]) -> None:
        """Numbers appended to a prompt's or stop_token_ids' array, counted against its bound."""
        frame.value.extend(ids)
        frame.count += len(ids)
        if frame.kind == _STOP_IDS:
            if frame.count > MAX_STOP_TOKEN_IDS:
                raise InvalidArgument(f"stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids; at most "
                                      f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
        elif self.bounds.max_prompt_ids and frame.count > self.bounds.max_prompt_ids:
            raise RequestTooLarge(f"prompt has more than {self.bounds.max_prompt_ids} token ids, more than any model "
                                  "on this router accepts (--max-prompt-tokens, or the model's context)", param="prompt")

    def _key(self, key: str) -> None:
        top = self._stack[-1]
        top.key = key
        if top.kind in (_MESSAGE, _PART):
            top.count += 1
            if top.count > MAX_OBJECT_KEYS:
                where = top.path()
                raise InvalidArgument(f"{where} has more than {MAX_OBJECT_KEYS} fields", param=where)

    def _open(self, container: dict | list) -> None:
        if not self._stack:
            if not isinstance(container, dict):
                raise InvalidArgument("the request body must be a JSON object ({...}), got an array")
            self._root = container
            self._stack.append(_Frame(container, _ROOT, None, None))
            return
        if len(self._stack) >= MAX_DEPTH:
            raise InvalidArgument(f"the request body nests deeper than {MAX_DEPTH} levels",
                                  param=self._stack[1].path() or None)
        parent = self._stack[-1]
        slot = parent.key if isinstance(parent.value, dict) else parent.count
        kind = self._place(container, is_container=True)
        self._stack.append(_Frame(container, kind, parent, slot))

    def _place(self, value: Any, is_container: bool) -> int:
        """Counts ``value`` against its parent's bound, stores it, and returns the kind it has as a container."""
        parent = self._stack[-1]
        kind = parent.kind
        if isinstance(parent.value, dict):
            key = parent.key
            parent.value[key] = value
            if kind == _ROOT:
                if key == "stop" and isinstance(value, str):
                    self._check_stop(value, "stop")
                child = _ROOT_ARRAYS.get(key, _OTHER) if isinstance(value, list) else _OTHER
                if child == _OTHER:
                    self._count_other()
                return child
            if kind == _MESSAGE and key == "content" and isinstance(value, list):
                return _PARTS
            if kind in (_MESSAGE, _PART) and not is_container:
                return _OTHER  # a field of a message or part: counted as a key
            self._count_other()
            return _OTHER
        # An element of an array.
        parent.value.append(value)
        parent.count += 1
        n, b = parent.count, self.bounds
        if kind == _MESSAGES:
            if n > b.max_messages:
                raise RequestTooLarge(f"messages has more than {b.max_messages} messages; this router takes at most "
                                      f"{b.max_messages} (--max-messages)", param="messages")
            return _MESSAGE if isinstance(value, dict) else _OTHER
        if kind == _PARTS:
            self._parts += 1
            if self._parts > b.max_content_parts:
                raise RequestTooLarge(f"the messages have more than {b.max_content_parts} content parts; this router "
                                      f"takes at most {b.max_content_parts} (--max-content-parts)",
                                      param=parent.path())
            return _PART if isinstance(value, dict) else _OTHER
        if kind == _STOP:
            if n > MAX_STOP_STRINGS:
                raise InvalidArgument(f"stop has more than {MAX_STOP_STRINGS} strings; at most {MAX_STOP_STRINGS}",
                                      param="stop")
            if isinstance(value, str):
                self._check_stop(value, f"stop[{n - 1}]")
        elif kind == _STOP_IDS:
            if n > MAX_STOP_TOKEN_IDS:
                raise InvalidArgument(f"stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids; at most "
                                      f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
        elif kind == _PROMPT and (is_container or isinstance(value, str)):
            self._prompts += 1
            if self._prompts > 1:
                raise InvalidArgument("prompt holds more than one prompt: kvmesh takes one prompt per request "
                                      "(send several requests)", param="prompt")
            return _PROMPT_IDS
        elif kind in (_PROMPT, _PROMPT_IDS):
            if b.max_prompt_ids and n > b.max_prompt_ids:
                raise RequestTooLarge(f"prompt has more than {b.max_prompt_ids} token ids, more than any model on "
                                      "this router accepts (--max-prompt-tokens, or the model's context)",
                                      param="prompt")
        else:
            self._count_other()
        return _OTHER

    @staticmethod
    def _check_stop(value: str, where: str) -> None:
        if not 0 < len(value) <= MAX_STOP_CHARS:
            raise InvalidArgument(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(value)} "
                                  f"in {where}", param="stop")

    def _count_other(self) -> None:
        self._other += 1
        if self._other > MAX_OTHER_VALUES:
            raise InvalidArgument(f"the request body holds more than {MAX_OTHER_VALUES} JSON values outside messages, "
                                  "prompt and stop: send only the parameters you use")


async def read_json_body(chunks: AsyncIterator[bytes], bounds: BodyBounds) -> dict[str, Any]:
    """The body from an async stream of chunks, parsed as they arrive; raises BodyTooLarge past
    ``bounds.max_bytes`` and InvalidArgument / RequestTooLarge at the first element past a bound."""
    return await read_json_parts(((chunk, False) async for chunk in chunks), bounds)


async def read_json_parts(parts: AsyncIterator[tuple[bytes, bool]], bounds: BodyBounds) -> dict[str, Any]:
    """:func:`read_json_body` from ``(chunk, last)`` pairs, where the source says which chunk ends the
    body (an ASGI message without ``more_body``): a small body in one chunk is read whole."""
    parser = BodyParser(bounds)
    seen = 0
    async for chunk, last in parts:
        seen += len(chunk)
        if seen > bounds.max_bytes:
            raise BodyTooLarge(bounds.max_bytes)
        if chunk or last:
            await parser.feed(chunk, last)
        if last:
            break
    return parser.close()

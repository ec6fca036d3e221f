"""A small body that arrives whole is read by json.loads (request_body.parse_whole): whatever it is, the
answer (the object, or the error with its message and param) is the streaming parser's."""

from __future__ import annotations

import json
import random

import pytest

from kvmesh.router.api.body_bounds import MAX_OBJECT_KEYS, MAX_OTHER_VALUES, BodyBounds
from kvmesh.router.api.request_body import BodyParser
from kvmesh.router.api.whole_body import parse_whole

BOUNDS = BodyBounds(max_bytes=100_000, max_messages=3, max_content_parts=4, max_prompt_ids=5, max_token_bytes=200)


async def _streamed(raw: bytes, bounds: BodyBounds) -> object:
    parser = BodyParser(bounds)
    try:
        for i in range(0, len(raw), 7):
            await parser.feed(raw[i:i + 7])
        return parser.close()
    except Exception as exc:  # noqa: BLE001 - the answer compared, whatever it is
        return type(exc), str(exc), getattr(exc, "param", None)


async def _whole(raw: bytes, bounds: BodyBounds) -> object:
    parser = BodyParser(bounds)
    try:
        await parser.feed(raw, last=True)
        return parser.close()
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc), getattr(exc, "param", None)


def _docs() -> list[bytes]:
    """Bodies at and past every bound of BOUNDS, and the JSON yajl and json.loads read differently."""
    msg = {"role": "user", "content": "hi"}
    part = {"type": "text", "text": "a"}
    docs: list[object] = [
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1},
        {"prompt": [1] * 5}, {"prompt": [1] * 6}, {"prompt": [[1] * 5]}, {"prompt": [[1] * 6]},
        {"prompt": [[1], [2]]}, {"prompt": ["a", "b"]}, {"prompt": ["a"]}, {"prompt": [1, "a"]}, {"prompt": [1, "a", "b"]},
        {"prompt": [1, None]}, {"prompt": [1, [2]]}, {"prompt": [{"a": 1}]}, {"prompt": []}, {"prompt": [True, 2.5]},
        {"prompt": "x" * 150}, {"prompt": "x" * 250}, {"prompt": [2**63 - 1]}, {"prompt": {"a": [1, 2]}},
        {"messages": [msg] * 3}, {"messages": [msg] * 4}, {"messages": "hi"}, {"messages": [1, "a"]},
        {"messages": [{"role": "user", "content": [part] * 4}]},
        {"messages": [{"content": [part] * 3}, {"content": [part] * 2}]},
        {"messages": [{"content": [part, "a"]}]}, {"messages": [{"content": [{"type": "text", "text": [1]}]}]},
        {"messages": [{f"k{i}": 1 for i in range(MAX_OBJECT_KEYS)}]},
        {"messages": [{f"k{i}": 1 for i in range(MAX_OBJECT_KEYS + 1)}]},
        {"messages": [{"role": "user", "content": {"a": 1}}]}, {"messages": [{"role": "user", "tool_calls": [{}]}]},
        {"stop": ["s"] * 16}, {"stop": ["s"] * 17}, {"stop": ["s", ""]}, {"stop": ""}, {"stop": "x" * 256},
        {"stop": "x" * 257}, {"stop": [1]}, {"stop": None}, {"stop": [["a"]]},
        {"stop_token_ids": [1] * 1024}, {"stop_token_ids": [1] * 1025}, {"stop_token_ids": [1, "a"]},
        {"stop_token_ids": [[1]]}, {"stop_token_ids": [1.5]},
        {"junk": list(range(MAX_OTHER_VALUES - 1))}, {"junk": list(range(MAX_OTHER_VALUES))},
        {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": 1}}}}}}}}},
        {"a": json.loads("[" * 33 + "1" + "]" * 33)},
        {"chat_template_kwargs": {"a": {"b": [1, 2.5, None, False]}}}, {"seed": 2**63 - 1}, {"seed": -(2**63) + 1},
        {"temperature": 1e308}, {"temperature": -0.0}, {"text": "\u00e9\u4e2d\U0001f600\x00"},
    ]
    raw = [json.dumps(d).encode() for d in docs] + [json.dumps(d, ensure_ascii=False).encode() for d in docs[-1:]]
    raw += [
        b"", b" ", b"[1, 2]", b'"x"', b"1", b"null", b"{not json", b'{"a": 1} x', b'{"a": 1}{}', b'{"messages": [',
        b'{"seed": 1180591620717411303424}', b'{"seed": 9223372036854775808}', b'{"seed": -9223372036854775808}',
        b'{"prompt": [-9223372036854775808]}', b'{"prompt": [9223372036854775808]}',
        b'{"t": 1e400}', b'{"t": -1e400}', b'{"prompt": [1e400]}', b'{"t": NaN}', b'{"t": Infinity}', b'{"t": -Infinity}',
        b'{"a": 1, "a": 2}', b'{"prompt": [1, 2, 3, 4, 5, 6], "prompt": [1]}',
        ('{"messages": [{' + ", ".join(f'"k{i}": 1' for i in range(MAX_OBJECT_KEYS)) + ', "k0": 2}]}').encode(),
        ("{" + ", ".join(f'"k{i}": {i}' for i in range(MAX_OTHER_VALUES + 1)) + "}").encode(),
        b'{"messages": [{"role": "a", "role": "b"}]}', b'{"prompt": [1], "prompt": [1, 2, 3, 4, 5, 6]}',
        b'{"s": "\\ud800"}', b'{"s": "\\ud83d\\ude00"}', b'{"s": "\\uDC00x"}', b'{"s": "\xff"}', b'{"s": "a\x01"}',
        b'\xef\xbb\xbf{"a": 1}', b'{"a": 1E5, "b": -0, "c": 1.0, "d": 2e-3}', b'{"a": 01}', b'{"a": .5}',
        b'{"a": [1,]}', b'{"a": 1,}', b"{'a': 1}", b'{"a": tru}', b'{"a": "x" /* c */}', b'\t{"a":\n1}\r\n',
    ]
    return raw


@pytest.mark.anyio
async def test_a_whole_body_is_answered_as_the_streaming_parser_answers():
    bodies = _docs()
    whole = 0
    for raw in bodies:
        parser = BodyParser(BOUNDS)
        await parser.feed(raw, last=True)
        whole += parser.read_whole
        for bounds in (BOUNDS, BodyBounds(100_000, 3, 4)):
            assert await _whole(raw, bounds) == await _streamed(raw, bounds), raw[:120]
    assert whole >= 20  # the bodies within the bounds, read by json.loads

@pytest.mark.anyio
async def test_mutated_bodies_are_answered_alike():
    """Random bytes changed in valid bodies: malformed JSON, numbers, strings, bounds, all alike."""
    rng = random.Random(49)
    seeds = [json.dumps(d).encode() for d in ({"model": "m", "prompt": [1, 2, 3], "stop": ["a"], "seed": 5},
                                              {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                                               "stop_token_ids": [1, 2], "temperature": 0.5})]
    alphabet = b'{}[],:"0123456789.-eE\\u tfn'
    for _ in range(3000):
        raw = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(raw))
            op = rng.random()
            if op < 0.4:
                raw[i] = rng.choice(alphabet)
            elif op < 0.7:
                raw[i:i] = bytes([rng.choice(alphabet)])
            else:
                del raw[i]
        body = bytes(raw)
        assert await _whole(body, BOUNDS) == await _streamed(body, BOUNDS), body


@pytest.mark.anyio
async def test_ordinary_bodies_take_the_whole_body_path():
    """Else the comparisons above would pass without the fast path ever running."""
    rng = random.Random(1)
    big = BodyBounds(1 << 26, 4096, 4096, 2 * 16000 + 16, 6 * 512000 + 1024)
    for doc in ({"prompt": [rng.randrange(3, 500) for _ in range(4096)], "max_tokens": 1},
                {"model": "default", "prompt": "Once upon a time " * 240, "max_tokens": 1, "temperature": 0,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
                {"model": "m", "messages": [{"role": "system", "content": "be terse"},
                                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_tokens": 32, "stop": ["\n\n"], "chat_template_kwargs": {"enable_thinking": False}}):
        raw = json.dumps(doc).encode()
        assert parse_whole(raw, big) == json.loads(raw)
        parser = BodyParser(big)
        await parser.feed(raw, last=True)
        assert parser.read_whole and parser.close() == json.loads(raw)

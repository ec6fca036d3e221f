"""Decoding the engines' event batches: real vLLM 0.32 payloads, the older array layout, SGLang's
layouts, unknown fields and types, and hostile input (never anything but BadPayload)."""

from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.bridge.engine_events import (
    MAX_TOKENS_PER_EVENT,
    BadPayload,
    EngineCleared,
    EngineRemoved,
    EngineStored,
    decode_batch,
    encode_batch,
)

DATA = Path(__file__).parent / "data"


def real_vllm_batches() -> list[tuple[int, bytes]]:
    d = json.loads((DATA / "vllm_0.32.0_batches.json").read_text())
    return [(b["seq"], base64.b64decode(b["payload_b64"])) for b in d["batches"]]


def test_real_vllm_payloads_decode_to_their_blocks():
    batches = [decode_batch(p) for _, p in real_vllm_batches()]
    first = batches[0].events[0]
    assert isinstance(first, EngineStored)
    assert (len(first.block_hashes), first.parent_block_hash, first.block_size, first.medium, first.group_idx,
            first.spec_kind, first.extra_keys) == (3, None, 32, "GPU", 0, "full_attention", (None, None, None))
    assert first.token_ids == tuple(range(10, 106)) and all(isinstance(h, int) for h in first.block_hashes)
    assert batches[0].rank == 0 and not batches[0].unknown and not batches[0].bad
    salted = batches[2].events[0]
    assert salted.extra_keys == (("tenant-a",), None, None) and salted.token_ids == tuple(range(200, 296))


def test_the_older_array_layout_and_sglang_layouts_decode_by_position():
    # vLLM <= 0.23 and SGLang's array_like structs: [tag, fields...]; SGLang's batch [ts, events]
    # (sgl-project/sglang python/sglang/srt/disaggregation/kv_events.py @ 006d053f: BlockStored is
    # block_hashes, parent_block_hash, token_ids, block_size, lora_id; BlockRemoved block_hashes).
    raw = msgpack.packb([1.5, [["BlockStored", [-5, 7], 3, [1, 2], 1, None], ["BlockRemoved", [-5]],
                               ["AllBlocksCleared"]]])
    b = decode_batch(raw)
    assert b.rank is None and b.events == [EngineStored((-5, 7), 3, (1, 2), 1), EngineRemoved((-5,)), EngineCleared()]
    # SGLang 0.5 tagged maps, with a medium and the attention-DP rank third
    raw = encode_batch([{"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [4],
                         "block_size": 1, "lora_id": None, "medium": "CPU_PINNED"}], ts=2.0, rank=3)
    b = decode_batch(raw)
    assert b.rank == 3 and b.events[0].medium == "CPU_PINNED"


def test_bytes_hashes_unknown_fields_and_unknown_types_are_tolerated():
    raw = encode_batch([
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32,
         "token_ids": [1, 2], "block_size": 2, "brand_new_field": {"x": 1}},
        {"type": "BlockPinned", "block_hashes": [1]},
    ])
    b = decode_batch(raw)
    assert b.events == [EngineStored((b"\x01" * 32,), b"\x02" * 32, (1, 2), 2)] and b.unknown == ["BlockPinned"]


@pytest.mark.parametrize(("payload", "reason"), [
    (b"", "not_msgpack"),
    (b"\xc1", "not_msgpack"),
    (b"\x91" * 100_000, "not_msgpack"),  # nested past msgpack's stack
    (msgpack.packb({"ts": 1}), "bad_batch"),
    (msgpack.packb([1.0]), "bad_batch"),
    (msgpack.packb(["x", []]), "bad_batch"),
    (msgpack.packb([1.0, list(range(70_000))]), "too_large"),
])
def test_malformed_batches_are_refused_with_a_reason(payload, reason):
    with pytest.raises(BadPayload) as exc:
        decode_batch(payload)
    assert exc.value.reason == reason


def test_a_bad_event_is_skipped_and_the_rest_of_its_batch_applies():
    good = {"type": "BlockRemoved", "block_hashes": [1]}
    huge = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [0] * (MAX_TOKENS_PER_EVENT + 1), "block_size": MAX_TOKENS_PER_EVENT + 1}
    wrong = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3],
             "block_size": 2}
    negative = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [-1],
                "block_size": 1}
    b = decode_batch(encode_batch([huge, wrong, negative, {"type": 7}, "junk", good]))
    assert b.events == [EngineRemoved((1,))] and b.bad == ["too_large", "bad_event", "bad_event", "bad_event",
                                                             "bad_event"]


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_bad_payload(raw):
    with contextlib.suppress(BadPayload):
        decode_batch(raw)


@settings(max_examples=300, deadline=None)
@given(st.lists(msgpack_values | st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved"])},
                                                        optional={"block_hashes": msgpack_values,
                                                                  "token_ids": msgpack_values,
                                                                  "block_size": msgpack_values,
                                                                  "parent_block_hash": msgpack_values,
                                                                  "extra_keys": msgpack_values}), max_size=4))
def test_random_structures_never_raise_anything_but_bad_payload(events):
    with contextlib.suppress(BadPayload):
        decode_batch(msgpack.packb([1.0, events, 0], use_bin_type=True))

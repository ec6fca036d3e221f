"""The engines' KV event messages, decoded by field name into plain types.

vLLM (vllm/distributed/kv_events.py) and SGLang (sglang/srt/disaggregation/kv_events.py) publish
one msgpack ``EventBatch`` per scheduler step: ``[ts, events, rank]`` (SGLang before 0.5: ``[ts,
events]``). Events are tagged maps ``{"type": "BlockStored", ...}`` in current releases and
positional arrays ``["BlockStored", ...]`` in older ones (vLLM <= 0.23, SGLang's array_like
structs); both decode here. Hashes arrive as ints (vLLM's default: the low 64 bits of its digest;
SGLang: a signed int64) or as bytes; unknown fields are ignored and unknown event types are counted,
so a newer engine never stops the bridge. Anything else malformed raises :class:`BadPayload`.

This module imports neither zmq nor grpc: it is pure and fuzzed (tests/bridge/).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

EngineHash = int | bytes
"""An engine's own block hash, as it sent it (never comparable with kvmesh's hashes)."""

MAX_PAYLOAD_BYTES = 32 << 20
"""A batch larger than this is refused (the ZMQ socket drops it before it is read)."""
MAX_EVENTS_PER_BATCH = 65_536
MAX_TOKENS_PER_EVENT = 1 << 20
"""Token ids in one BlockStored (a 1M-token prefill in one step is already far past any engine)."""
MAX_HASHES_PER_EVENT = 65_536
MAX_HASH_BYTES = 64

# NOTE: the positional layouts, field by field, of the releases that sent arrays. vLLM's
# BlockStored grew fields at its end (lora_id, medium, lora_name, extra_keys, group_idx, ...); a
# shorter array is an older release.
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


class BadPayload(ValueError):
    """A message that is not an engine's event batch; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(slots=True, frozen=True)
class EngineStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    """All the blocks' tokens, block after block: len = len(block_hashes) * block_size; empty for a
    store that names its blocks only (vLLM's offloading connector by default)."""
    block_size: int
    medium: str | None = None
    """"GPU" (vLLM; also on its CPU build), "CPU", "STORAGE" (vLLM's offloading), "CPU_PINNED", "DISK"
    (SGLang), ...; None = not said (the device)."""
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    """Per block: the engine's extra hash inputs (LoRA name, multimodal ids, cache salt), or None."""
    group_idx: int = 0
    spec_kind: str | None = None
    """vLLM's ``kv_cache_spec_kind``: "full_attention", "sliding_window", ...; None = not said."""
    sliding_window: int | None = None
    cache_salt: str | None = None
    """SGLang (0.5.x) names the request's salt in a field of its own; vLLM puts it in extra_keys."""


@dataclass(slots=True, frozen=True)
class EngineRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(slots=True, frozen=True)
class EngineCleared:
    pass


EngineEvent = EngineStored | EngineRemoved | EngineCleared


@dataclass(slots=True)
class EngineBatch:
    ts: float
    events: list[EngineEvent]
    rank: int | None = None
    unknown: list[str] = field(default_factory=list)
    """Type names of events this bridge does not know (skipped)."""
    bad: list[str] = field(default_factory=list)
    """Reasons of events that could not be decoded (skipped; the rest of the batch applies)."""


def _hash(value: Any, what: str) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise BadPayload("bad_hash", f"{what} is {type(value).__name__}, not an int or bytes")
    if isinstance(value, bytes) and not 0 < len(value) <= MAX_HASH_BYTES:
        raise BadPayload("bad_hash", f"{what} has {len(value)} bytes")
    return value


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list | tuple):
        raise BadPayload("bad_event", "block_hashes is not a list")
    if len(value) > MAX_HASHES_PER_EVENT:
        raise BadPayload("too_large", f"{len(value)} block hashes in one event")
    return tuple(_hash(h, "a block hash") for h in value)


def _int(value: Any, what: str, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadPayload("bad_event", f"{what} is {type(value).__name__}, not an int")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise BadPayload("bad_event", f"{what} is {type(value).__name__}, not a string")


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """(type name, fields by name) of one event in either layout."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise BadPayload("bad_event", "an event map without a string 'type'")
        return kind, raw
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _ARRAY_FIELDS.get(kind)
        if names is None:
            return kind, {}
        return kind, dict(zip(names, raw[1:], strict=False))
    raise BadPayload("bad_event", f"an event is {type(raw).__name__}, not a tagged map or array")


def _stored(f: dict[str, Any]) -> EngineStored:
    hashes = _hashes(f.get("block_hashes"))
    tokens = f.get("token_ids")
    if not isinstance(tokens, list | tuple):
        raise BadPayload("bad_event", "BlockStored.token_ids is not a list")
    if len(tokens) > MAX_TOKENS_PER_EVENT:
        raise BadPayload("too_large", f"{len(tokens)} token ids in one BlockStored")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens):
        raise BadPayload("bad_event", "BlockStored.token_ids holds something that is not a token id")
    block_size = _int(f.get("block_size"), "BlockStored.block_size")
    # NOTE: no token ids at all is a store that names its blocks only (vLLM's offloading connector
    # without self-describing events: block_size 0, its hash); the mirror resolves it by hash.
    if tokens and (block_size < 1 or len(tokens) != block_size * len(hashes)):
        raise BadPayload("bad_event", f"{len(tokens)} token ids for {len(hashes)} blocks of {block_size}")
    parent = f.get("parent_block_hash")
    extra = f.get("extra_keys")
    if extra is not None:
        if not isinstance(extra, list | tuple) or len(extra) != len(hashes):
            raise BadPayload("bad_event", "BlockStored.extra_keys is not one entry per block")
        extra = tuple(tuple(e) if isinstance(e, list | tuple) else e for e in extra)
    window = f.get("kv_cache_spec_sliding_window")
    return EngineStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=_opt_str(f.get("medium"), "BlockStored.medium"),
        lora_name=_opt_str(f.get("lora_name"), "BlockStored.lora_name"),
        extra_keys=extra,
        group_idx=_int(f.get("group_idx"), "BlockStored.group_idx", 0),
        spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "BlockStored.kv_cache_spec_kind"),
        sliding_window=None if window is None else _int(window, "kv_cache_spec_sliding_window"),
        cache_salt=_opt_str(f.get("cache_salt"), "BlockStored.cache_salt"),
    )


def _removed(f: dict[str, Any]) -> EngineRemoved:
    return EngineRemoved(_hashes(f.get("block_hashes")), _opt_str(f.get("medium"), "BlockRemoved.medium"),
                         _int(f.get("group_idx"), "BlockRemoved.group_idx", 0))


def decode_event(raw: Any) -> EngineEvent | str:
    """One event; an unknown type comes back as its name."""
    kind, f = _fields(raw)
    if kind == "BlockStored":
        return _stored(f)
    if kind == "BlockRemoved":
        return _removed(f)
    if kind == "AllBlocksCleared":
        return EngineCleared()
    return kind[:64]


def decode_batch(payload: bytes) -> EngineBatch:
    """One ZMQ payload. Raises BadPayload (never anything else) when it is not an event batch."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadPayload("too_large", f"{len(payload)} bytes")
    try:
        # (msgpack >= 1.0 bounds every string, array and map by the payload's own size)
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            msgpack.OutOfData) as exc:
        raise BadPayload("not_msgpack", f"{type(exc).__name__}: {exc}"[:200]) from None
    except Exception as exc:  # noqa: BLE001 - msgpack raises assorted errors on hostile input
        raise BadPayload("not_msgpack", type(exc).__name__) from None
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise BadPayload("bad_batch", "not an [ts, events, ...] array")
    ts, events = raw[0], raw[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list | tuple):
        raise BadPayload("bad_batch", "not an [ts, events, ...] array")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise BadPayload("too_large", f"{len(events)} events in one batch")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) and not isinstance(raw[2], bool) else None
    batch = EngineBatch(float(ts), [], rank)
    for e in events:
        try:
            out = decode_event(e)
        except BadPayload as exc:
            batch.bad.append(exc.reason)
            continue
        if isinstance(out, str):
            batch.unknown.append(out)
        else:
            batch.events.append(out)
    return batch


def encode_batch(events: Sequence[dict[str, Any]], ts: float = 0.0, rank: int | None = 0) -> bytes:
    """A batch in the tagged-map layout (tests and the bench's fault injection)."""
    body: list[Any] = [ts, list(events)]
    if rank is not None:
        body.append(rank)
    return msgpack.packb(body, use_bin_type=True)

"""The Redis store's payloads and replies (kv_service/store_redis.py): events as the publish script takes
them, and the lookup script's and the plain reads' answers as records. No I/O."""

from __future__ import annotations

from typing import Any

from kvmesh.contract.index_protocol import NO_PENDING, Pending
from kvmesh.contract.types import AllBlocksCleared, BlockStored, KVCacheEvent, Tier
from kvmesh.kv_service.redis_cluster import as_str as _s

_OPS = {(True, Tier.DEVICE): "S", (False, Tier.DEVICE): "R", (True, Tier.HOST): "HS", (False, Tier.HOST): "HR"}
"""The publish script's op of a (stored?, tier) event."""


def split_payload(events: list[KVCacheEvent], limit: int) -> list[list]:
    """The publish script's payload ('S' / 'R' hashes of the device tier, 'HS' / 'HR' of the host
    tier, 'C'; the hashes of one event as one concatenated string) in parts of at most ``limit``
    hashes each, in event order; a long event is cut across parts. Disk-tier events are not kept
    (the caller counts them)."""
    parts: list[list] = []
    cur: list = []
    size = 0
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            cur.append("C")
            continue
        op = _OPS.get((isinstance(ev, BlockStored), ev.tier))
        if op is None:
            continue
        hashes = ev.block_hashes
        i = 0
        while i < len(hashes):
            if size >= limit:
                parts.append(cur)
                cur, size = [], 0
            chunk = hashes[i:i + limit - size]
            cur += [op, b"".join(chunk)]
            size += len(chunk)
            i += len(chunk)
    parts.append(cur)
    return parts


def holders_by_worker(groups: list) -> dict[bytes, Any]:
    """lookup.lua's {k, "num,num,...", ...} as worker number -> k."""
    return {num: k for i in range(0, len(groups), 2) for k in (groups[i],) for num in groups[i + 1].split(b",")}


def split_info(raw: bytes | None) -> tuple[bytes, str, str, str]:
    """A worker's ``ld:<model>`` entry "num|bs|load|addr" as (num, bs, load, addr).

    NOTE: an entry written before it named the worker's number ("addr|bs|load", before issue 37)
    has none (b""): the worker matches nothing in Lookups until its next load report (a heartbeat,
    a third of a lease at most) rewrites it."""
    if not raw:
        return b"", "", "", ""
    parts = raw.split(b"|", 3)
    if len(parts) == 4 and parts[0].isdigit():
        return parts[0], _s(parts[1]), _s(parts[2]), _s(parts[3])
    addr, bs, load = (_s(raw).split("|", 2) + ["", ""])[:3]
    return b"", bs, load, addr


def as_map(reply: dict | list) -> dict:
    """HGETALL's reply: a map in RESP3 (redis-py's default), a flat list in RESP2."""
    return reply if isinstance(reply, dict) else dict(zip(reply[0::2], reply[1::2], strict=True))


def pending_of(raw: bytes | str | None) -> Pending:
    """A worker's "picks,prefill,blocks,version" (pd:<model>); none = no pick ever."""
    if not raw:
        return NO_PENDING
    n, pf, b, v = _s(raw).split(",")
    return Pending(int(n), int(pf), int(b), int(v))

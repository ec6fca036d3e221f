"""The kv_service core: validates requests, applies them to a BlockIndex, keeps counters.

No grpc and no redis here: kv_service/server.py adapts protobuf messages to these calls. The
methods are coroutines because the Redis store awaits its round trips; on the memory store none
ever suspends, so a caller without an event loop (the simulator) can drive them with ``run_now``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

from kvmesh.contract.block_hash import ALGORITHMS, HASH_LEN, BlockHasher
from kvmesh.contract.errors import InvalidArgument, KVMeshError
from kvmesh.contract.index_protocol import (
    Registration,
    Reservation,
    ReservationAnswer,
    WorkerAudit,
    WorkerMatch,
)
from kvmesh.contract.kv_transfer import check_role
from kvmesh.contract.limits import (
    MAX_ADAPTER_NAME_CHARS,
    MAX_ADAPTERS,
    MAX_ADDRESS_CHARS,
    MAX_ADMITTED_IDS,
    MAX_CACHE_SALT_CHARS,
    MAX_CHAIN_BLOCKS,
    MAX_MODEL_ID_CHARS,
    MAX_SNAPSHOT_HOST_BLOCKS,
    MAX_TOKEN_ID,
    MAX_WORKER_ID_CHARS,
    MAX_WORKER_REQUEST_ID_CHARS,
    check_id,
    check_length,
    excerpt,
)
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, Load, Tier
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.index import Action, BlockIndex, PublishResult
from kvmesh.kv_service.metrics import KVMetrics
from kvmesh.kv_service.pending_prefixes import PendingPrefixes

__all__ = ["MAX_CHAIN_BLOCKS", "MAX_TOKEN_ID", "HeartbeatAnswer", "KVService", "run_now"]

MAX_EPOCH = 2**53 - 1  # exact in a Lua double
MAX_PICK_TOKENS = 2**40
MAX_AUDIT_WORKERS = 4096
"""Workers one ReportAudit names at most."""
MAX_AUDITED_WORKERS = 65_536
"""Workers this replica keeps audit sums of; past it the longest-known go."""
MAX_ANCHORS = 64
"""Anchors one Reserve carries at most (a chain of 65,536 blocks has 18)."""
_ID_RE = re.compile(rf"^[A-Za-z0-9._:@/-]{{1,{MAX_WORKER_ID_CHARS}}}$")
_ENGINE_RE = re.compile(r"^[A-Za-z0-9._-]{1,32}$")
HASH_IN_THREAD_TOKENS = 16_384
"""LookupTokens hashes longer prompts on a worker thread: ~1.3 ms of the loop per 16k tokens
(sha256_128) is the most one admin call may hold every other request up."""

T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine that never suspends (a KVService call on the memory store) to its end,
    without an event loop. Raises RuntimeError if it does suspend."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the coroutine suspended: run it on an event loop (the store does I/O)")


def now_ms() -> int:
    return int(time.time() * 1000)


LEAVE_REASONS = ("draining", "unreachable")
"""Why a worker leaves the live set (LeaveWorker): it drains, or a front cannot reach it."""
MAX_REPORTER_CHARS = 128


class HeartbeatAnswer(NamedTuple):
    lease_ttl_ms: int
    resync: bool
    """The index dropped the worker's blocks (FlushWorker): it should send a snapshot."""


def _check_id(what: str, value: str) -> None:
    if not _ID_RE.match(value or ""):
        raise InvalidArgument(
            f"{what} must be 1-{MAX_WORKER_ID_CHARS} characters of letters, digits and . _ : @ / -, "
            f"got {excerpt(value)}"
        )


def _check_model_id(value: str, what: str = "model_id") -> None:
    if not value:
        raise InvalidArgument(f"{what} is empty: name the model (1-{MAX_MODEL_ID_CHARS} characters)")
    check_length(what, value, MAX_MODEL_ID_CHARS)


def _check_hashes(what: str, hashes: Sequence[bytes], *, allow_empty: bool = True,
                  limit: int = MAX_CHAIN_BLOCKS) -> list[bytes]:
    if not allow_empty and not hashes:
        raise InvalidArgument(f"{what} is empty: send at least one {HASH_LEN}-byte block hash")
    if len(hashes) > limit:
        raise InvalidArgument(f"{what} has {len(hashes)} hashes; at most {limit} per message")
    # NOTE: copied once (a protobuf repeated field makes a bytes object per read), checked at C level;
    # the loop below only names the bad one
    hashes = list(hashes)
    if not hashes or set(map(len, hashes)) == {HASH_LEN}:
        return hashes
    for i, h in enumerate(hashes):
        if len(h) != HASH_LEN:
            raise InvalidArgument(
                f"{what}[{i}] is {len(h)} bytes; block hashes are {HASH_LEN} bytes (docs/block-hashing.md)"
            )
    return hashes


def _check_hash(what: str, h: bytes) -> None:
    if len(h) != HASH_LEN:
        raise InvalidArgument(f"{what} is {len(h)} bytes; block hashes are {HASH_LEN} bytes (docs/block-hashing.md)")


def _check_load(load: Load) -> None:
    if len(load.admitted) > MAX_ADMITTED_IDS:
        raise InvalidArgument(f"load.admitted_request_ids has {len(load.admitted)} ids; at most {MAX_ADMITTED_IDS} "
                              "per report")
    for i, rid in enumerate(load.admitted):
        check_id(f"load.admitted_request_ids[{i}]", rid, MAX_WORKER_REQUEST_ID_CHARS)
    if len(load.adapters) > MAX_ADAPTERS:
        raise InvalidArgument(f"load.adapters lists {len(load.adapters)} adapters; at most {MAX_ADAPTERS} per report")
    for i, a in enumerate(load.adapters):
        if not 1 <= len(a.name) <= MAX_ADAPTER_NAME_CHARS or not a.name.isprintable():
            raise InvalidArgument(f"load.adapters[{i}].name must be 1-{MAX_ADAPTER_NAME_CHARS} printable characters")


def _check_counter(what: str, value: int) -> None:
    if not 1 <= value <= MAX_EPOCH:
        raise InvalidArgument(f"{what} must be in [1, 2**53), got {value}")


class KVService:
    """Validation + index + counters, for one event loop (or ``run_now`` on the memory store); with an
    ``events`` writer, ``publish``, ``snapshot`` and ``reap`` run on the writer's loop instead, and what they
    share with the reads (the metrics, the pending prefixes) is safe across threads.

    Args:
        metrics: where to count (the server's, served on /metrics); default: a private registry.
        clock: the index's time in ms (wall time; the simulator's virtual clock).
        events: the index's writer (``BlockIndex.writer``) that event batches, snapshots and the reaper
            go through, from the event loop it is bound to; default: ``index``.
    """

    def __init__(self, index: BlockIndex, config: ServiceConfig | None = None,
                 metrics: KVMetrics | None = None, clock: Callable[[], int] = now_ms,
                 events: BlockIndex | None = None) -> None:
        self.index = index
        self.events = events or index
        """Where event batches are applied (docs/kv-service.md "Reads apart from ingest")."""
        self.config = config or ServiceConfig()
        index.pending_config = self.events.pending_config = self.config.pending
        self.metrics = metrics or KVMetrics()
        self._now = clock
        self.prefixes = PendingPrefixes(self.config.pending.prefix_ttl_ms)
        self.audits: dict[str, WorkerAudit] = {}
        """The routers' miss audits reported to this replica, summed per worker (kept in the process)."""
        self.lookups_total = 0
        self.events_applied_total = 0
        self.resyncs_total = 0

    # -- workers -------------------------------------------------------------------------
    async def register(self, reg: Registration) -> int:
        _check_id("worker_id", reg.worker_id)
        _check_model_id(reg.model_id)
        check_length("address", reg.address, MAX_ADDRESS_CHARS)
        host, sep, port = reg.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(f"address must be host:port as routers should dial it, got {excerpt(reg.address)}")
        if not 1 <= reg.block_size <= 4096:
            raise InvalidArgument(f"block_size must be in [1, 4096], got {reg.block_size}")
        if reg.hash_algorithm not in ALGORITHMS:
            raise InvalidArgument(f"hash_algorithm must be one of {', '.join(ALGORITHMS)}")
        if reg.num_blocks < 1:
            raise InvalidArgument(f"num_blocks must be >= 1, got {reg.num_blocks}")
        if not 0 <= reg.host_blocks < 2**32:
            raise InvalidArgument(f"host_blocks must be in [0, 2**32) (0 = no host tier declared), got {reg.host_blocks}")
        _check_counter("epoch", reg.epoch)
        if not _ENGINE_RE.match(reg.engine):
            raise InvalidArgument(f"engine must be 1-32 characters of letters, digits, '.', '_' and '-' (kvmesh, vllm, "
                                  f"sglang), got {excerpt(reg.engine)}")
        check_role(reg.role)
        await self.index.register_worker(reg, self.config.lease_ttl_ms, self._now())
        return self.config.lease_ttl_ms

    async def heartbeat(self, worker_id: str, epoch: int, load: Load) -> HeartbeatAnswer:
        _check_id("worker_id", worker_id)
        _check_load(load)
        resync = await self.index.heartbeat(worker_id, epoch, load, self.config.lease_ttl_ms, self._now())
        return HeartbeatAnswer(self.config.lease_ttl_ms, bool(resync))

    async def leave(self, worker_id: str, epoch: int, reason: str, reporter: str = "") -> bool:
        """The worker leaves the live set now (its lease ends; the reaper takes its blocks). ``epoch`` 0:
        whichever process is live; another epoch than the live one: a report on an earlier process,
        ignored. False: not live (already gone)."""
        _check_id("worker_id", worker_id)
        if reason not in LEAVE_REASONS:
            raise InvalidArgument(f"reason must be one of {', '.join(LEAVE_REASONS)}")
        check_length("reporter", reporter, MAX_REPORTER_CHARS)
        now = self._now()
        live = next((i for i in await self.index.workers(now) if i.registration.worker_id == worker_id), None)
        if live is None or (epoch and live.registration.epoch != epoch):
            return False
        try:
            # NOTE: a heartbeat with a lease of 0 ends the lease now in every store (and checks the epoch).
            await self.index.heartbeat(worker_id, live.registration.epoch, live.load, 0, now)
        except KVMeshError:  # gone or registered again in between
            return False
        self.metrics.leaves.labels(reason).inc()
        return True

    # -- events --------------------------------------------------------------------------
    async def publish(self, worker_id: str, epoch: int, seq: int, events: list[KVCacheEvent],
                      load: Load | None = None) -> PublishResult:
        _check_id("worker_id", worker_id)
        _check_counter("epoch", epoch)
        _check_counter("seq", seq)
        if load is not None:
            _check_load(load)
        for i, ev in enumerate(events):
            if isinstance(ev, BlockStored):
                _check_hashes(f"events[{i}].stored.block_hashes", ev.block_hashes)
                if ev.parent_block_hash is not None:
                    _check_hash(f"events[{i}].stored.parent_hash", ev.parent_block_hash)
            elif isinstance(ev, BlockRemoved):
                _check_hashes(f"events[{i}].removed.block_hashes", ev.block_hashes)
        events = self._kept_tiers(events)
        result = await self.events.publish(worker_id, epoch, seq, events, self._now(), load)
        self._count(result, events)
        if result.action == Action.ACK and self.prefixes:
            # NOTE: a block the worker evicted from its device is not held there whatever a reserved
            # pick's anchors said (a prompt evicted to the host tier within the anchors' TTL was still
            # priced as a device hit)
            for ev in events:
                if isinstance(ev, BlockRemoved) and ev.tier == Tier.DEVICE:
                    self.prefixes.forget(worker_id, ev.block_hashes)
        return result

    def _kept_tiers(self, events: list[KVCacheEvent]) -> list[KVCacheEvent]:
        """The events the index applies: the device's and the host tier's (and clears).

        NOTE: the disk tier (a bridged engine's storage) is validated and counted, never applied:
        routing has no price for it yet. The batch's seq still counts (the caller applies the rest),
        so a batch of disk events alone is no gap.
        """
        if all(ev.tier != Tier.DISK for ev in events if not isinstance(ev, AllBlocksCleared)):
            return events
        kept: list[KVCacheEvent] = []
        for ev in events:
            if isinstance(ev, AllBlocksCleared) or ev.tier != Tier.DISK:
                kept.append(ev)
            else:
                kind = "stored" if isinstance(ev, BlockStored) else "removed"
                self.metrics.events_ignored.labels(kind, ev.tier.name.lower()).inc(len(ev.block_hashes))
        return kept

    async def snapshot(self, worker_id: str, epoch: int, seq: int, hashes: list[bytes],
                       load: Load | None = None, host_hashes: Sequence[bytes] = ()) -> PublishResult:
        _check_id("worker_id", worker_id)
        _check_counter("epoch", epoch)
        _check_counter("seq", seq)
        hashes = _check_hashes("snapshot_hashes", hashes)
        host = _check_hashes("snapshot_host_hashes", host_hashes, limit=MAX_SNAPSHOT_HOST_BLOCKS)
        if load is not None:
            _check_load(load)
        result = await self.events.snapshot(worker_id, epoch, seq, hashes, self._now(), load, host)
        self.metrics.events_applied.labels("snapshot").inc(len(hashes) + len(host))
        return result

    def _count(self, result: PublishResult, events: list[KVCacheEvent]) -> None:
        if result.action == Action.RESYNC:
            self.metrics.resyncs.inc()
            self.resyncs_total += 1
            return
        applied: dict[str, int] = {}
        for ev in events:
            kind = "stored" if isinstance(ev, BlockStored) else "removed" if isinstance(ev, BlockRemoved) else "all_cleared"
            applied[kind] = applied.get(kind, 0) + (1 if isinstance(ev, AllBlocksCleared) else len(ev.block_hashes))
        for kind, n in applied.items():  # NOTE: one labelled inc per kind, not per event
            self.metrics.events_applied.labels(kind).inc(n)
        self.events_applied_total += len(events)

    # -- the shared router view -----------------------------------------------------------
    async def reserve(self, r: Reservation) -> ReservationAnswer:
        """A router's pick, visible to every Lookup until the worker's report covers it."""
        self._check_reservation(r)
        now = self._now()
        if r.release_worker_id:
            # NOTE: the prefix the released pick said its worker would hold goes with it.
            self.prefixes.forget(r.release_worker_id, r.anchors)
        result = await self.index.reserve(r, now)
        self.metrics.reservations.labels("reserved" if result.reserved else "conflict").inc()
        if result.reserved:
            self.prefixes.add(r.worker_id, r.anchors, now)
        elif r.anchors:
            # NOTE: a burst's Lookups are all answered before any of its picks lands: the refusal is
            # where a router first learns of the other routers' copies of its prefix.
            anchored = self.prefixes.match_anchors(r.anchors, now)
            if anchored:
                result = dataclasses.replace(result, anchored=anchored)
        return result

    def _check_reservation(self, r: Reservation) -> None:
        _check_model_id(r.model_id)
        _check_id("worker_id", r.worker_id)
        _check_id("router_id", r.router_id)
        check_id("request_id", r.request_id, MAX_WORKER_REQUEST_ID_CHARS)
        if not 0 <= r.prefill_tokens <= MAX_PICK_TOKENS or not 0 <= r.blocks < 2**32:
            raise InvalidArgument(f"prefill_tokens must be in [0, 2**40] and blocks in [0, 2**32), got "
                                  f"{r.prefill_tokens} and {r.blocks}")
        if r.seen_version is not None and not 0 <= r.seen_version <= MAX_EPOCH:
            raise InvalidArgument(f"seen_version must be in [0, 2**53), got {r.seen_version}")
        if len(r.anchors) > MAX_ANCHORS:
            raise InvalidArgument(f"anchors has {len(r.anchors)} hashes; at most {MAX_ANCHORS} (blocks 1, 2, 4, ... "
                                  "and the last of a chain)")
        _check_hashes("anchors", r.anchors)
        if r.release_worker_id:
            _check_id("release_worker_id", r.release_worker_id)

    # -- lookups -------------------------------------------------------------------------
    async def lookup(self, model_id: str, hashes: Sequence[bytes]) -> list[WorkerMatch]:
        return (await self.lookup_reserve(model_id, hashes, None))[0]

    async def lookup_reserve(self, model_id: str, hashes: Sequence[bytes],
                             reservation: Reservation | None) -> tuple[list[WorkerMatch], bool]:
        """:meth:`lookup`, and with ``reservation`` that pick reserved in the same atomic step, after the
        answer was read (the Reserve folded into the Lookup, docs/router.md): (the answer, reserved)."""
        _check_model_id(model_id)
        chain = _check_hashes("block_hashes", hashes, allow_empty=False)
        if reservation is not None:
            self._check_reservation(reservation)
            if reservation.model_id != model_id:
                raise InvalidArgument(f"reserve.model_id {excerpt(reservation.model_id)} is not the Lookup's model")
        t0 = time.perf_counter()
        now = self._now()
        found = await self.index.lookup(model_id, chain, now)
        held = self.prefixes.match(chain, now)
        if held:
            found = [w._replace(pending_blocks=held[w.worker_id]) if w.worker_id in held else w for w in found]
        reserved = False
        if reservation is not None:
            reserved = await self._fold(reservation, found, now)
        m = self.metrics
        m.lookup_latency.observe(time.perf_counter() - t0)
        m.lookups.inc()
        m.matched_blocks.observe(max((w.matched_blocks for w in found), default=0))
        self.lookups_total += 1
        return sorted(found, key=lambda m: (-m.matched_blocks, m.worker_id)), reserved

    async def _fold(self, r: Reservation, found: list[WorkerMatch], now: int) -> bool:
        """The Lookup's folded reservation (issue 45), made after its answer was read, conditioned on that
        answer (no other router reserved the worker since it: the version it holds), and only when the
        answer gives the router no reason to move its guess: the guessed worker holds (or will hold, by a
        reserved pick's anchors) the longest prefix of the chain any worker does, or none holds any. A guess
        the answer contradicts would advertise a copy of the prefix nobody makes (its anchors) until the
        router released it: three routers then piled a burst onto those phantoms (kvmesh simulate)."""
        guess = next((m for m in found if m.worker_id == r.worker_id), None)
        if guess is None:
            return False
        best = max(max(m.matched_blocks, m.pending_blocks) for m in found)
        if best and max(guess.matched_blocks, guess.pending_blocks) < best:
            self.metrics.reservations.labels("fold_skipped").inc()
            return False
        try:
            answer = await self.index.reserve(dataclasses.replace(r, seen_version=guess.pending.version), now)
        except KVMeshError:
            return False
        self.metrics.reservations.labels("reserved" if answer.reserved else "conflict").inc()
        if answer.reserved:
            self.prefixes.add(r.worker_id, r.anchors, now)
        return answer.reserved

    async def lookup_tokens(self, model_id: str, token_ids: Sequence[int], cache_salt: str = "") -> tuple[int, list[WorkerMatch]]:
        """Hashes ``token_ids`` with the model's registered spec; returns (block_size, matches).

        A model no live worker serves answers (0, []), as ``lookup`` answers [] for it.
        """
        _check_model_id(model_id)
        check_length("cache_salt", cache_salt, MAX_CACHE_SALT_CHARS)
        bad = next((i for i, t in enumerate(token_ids) if t >= MAX_TOKEN_ID), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids[{bad}] is {token_ids[bad]}; token ids are < 2**31 "
                                  "(hashed as int32, docs/block-hashing.md)")
        spec = await self.index.model_spec(model_id)
        if spec is None:
            return 0, []
        max_tokens = MAX_CHAIN_BLOCKS * spec.block_size
        if len(token_ids) > max_tokens:
            raise InvalidArgument(f"token_ids has {len(token_ids)} ids; at most {max_tokens} "
                                  f"({MAX_CHAIN_BLOCKS} blocks of {spec.block_size}) per lookup")
        hasher = BlockHasher(model_id, spec.block_size, spec.hash_algorithm)
        ids = list(token_ids)
        if len(ids) > HASH_IN_THREAD_TOKENS:
            hashes = await asyncio.to_thread(hasher.hash_prompt, ids, cache_salt)
        else:
            hashes = hasher.hash_prompt(ids, cache_salt)
        if not hashes:
            raise InvalidArgument(
                f"{len(token_ids)} tokens make no full block of {spec.block_size}; send at least {spec.block_size}"
            )
        return spec.block_size, await self.lookup(model_id, hashes)

    # -- the routers' miss audit ---------------------------------------------------------
    def report_audit(self, router_id: str, audits: dict[str, WorkerAudit]) -> None:
        """A router's audit counts since its last report, added to this replica's sums."""
        _check_id("router_id", router_id)
        if len(audits) > MAX_AUDIT_WORKERS:
            raise InvalidArgument(f"workers has {len(audits)} entries; at most {MAX_AUDIT_WORKERS} per report")
        for worker_id, a in audits.items():
            _check_id("workers[].worker_id", worker_id)
            if not all(0 <= v <= MAX_EPOCH for v in (a.requests, a.predicted_blocks, a.cached_blocks,
                                                    a.predicted_hits, a.cached_hits, a.silent_misses, a.unseen_hits)):
                raise InvalidArgument(f"workers[{worker_id!r}]: every count must be in [0, 2**53)")
        for worker_id, a in audits.items():
            if worker_id not in self.audits and len(self.audits) >= MAX_AUDITED_WORKERS:
                self.audits.pop(next(iter(self.audits)))  # NOTE: the longest-known first: workers that left
            self.audits.setdefault(worker_id, WorkerAudit()).add(a)

    async def audit(self) -> dict[str, WorkerAudit]:
        """Every audited worker's sums, each with its engine (its registration's; "" once it left)."""
        engines = {w.registration.worker_id: w.registration.engine
                   for w in await self.index.workers(self._now(), include_expired=True)}
        out = {}
        for worker_id in sorted(self.audits):
            a = dataclasses.replace(self.audits[worker_id], engine=engines.get(worker_id, ""))
            out[worker_id] = a
        return out

    async def get_block(self, block_hash: bytes) -> tuple[list[str], list[str]]:
        """(live workers holding the block on their device, those holding it in their host tier)."""
        _check_hash("block_hash", block_hash)
        now = self._now()
        return await self.index.holders(block_hash, now), await self.index.holders(block_hash, now, Tier.HOST)

    async def flush(self, worker_id: str) -> int:
        """Drops the worker's blocks from the index and asks it to resync (docs/kv-service.md):
        its next heartbeat or event batch is answered RESYNC, it sends a snapshot of its cache,
        and the index holds exactly that cache again."""
        _check_id("worker_id", worker_id)
        return await self.index.flush_worker(worker_id)

    async def reap(self) -> int:
        return await self.events.reap_expired(self._now())

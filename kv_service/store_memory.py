"""The embedded in-memory index: same semantics as the Redis store, for single-process use.

Its coroutines never suspend: each call completes on its first step (a simulator may drive
them without an event loop, see kvmesh.kv_service.service.run_now). The lock keeps it safe for
callers on several threads."""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.contract.index_protocol import (
    Pending,
    Registration,
    Reservation,
    ReservationAnswer,
    WorkerInfo,
    WorkerMatch,
)
from kvmesh.contract.types import AllBlocksCleared, BlockStored, KVCacheEvent, Load, ModelSpec, Tier
from kvmesh.kv_service.config import LOOKUP_WALKS
from kvmesh.kv_service.index import FLUSHED, Action, BlockIndex, IndexStats, PublishResult
from kvmesh.kv_service.prefix_search import continue_prefixes, linear_prefix, search_prefixes
from kvmesh.kv_service.refusals import Refusal, refuse


@dataclass(slots=True)
class _Worker:
    reg: Registration
    lease_expiry_ms: int
    last_seq: int = 0
    load: Load = field(default_factory=Load)
    # NOTE: insertion order is LRU order (oldest first); a re-stored block moves to the end.
    lru: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    host: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    """The host tier's blocks, as ``lru`` is the device's."""
    resync: bool = False
    """Flushed: owes a snapshot (heartbeats say so, event batches are answered RESYNC)."""
    picks: dict[str, tuple[int, str, int, int, int]] = field(default_factory=dict)
    """Pending picks: request id -> (taken at ms, router id, version, prefill tokens, blocks), oldest first."""
    pick_version: int = 0


_NOBODY: frozenset[str] = frozenset()


class MemoryIndex(BlockIndex):
    """Args:
    lookup_walk: ``search`` (each worker's match in O(log n) probes, kv_service/prefix_search.py) or
        ``linear`` (the walk down the chain to the first block no worker left holds, as before).
    """

    name = "memory"

    def __init__(self, lookup_walk: str = "search") -> None:
        if lookup_walk not in LOOKUP_WALKS:
            raise ValueError(f"lookup_walk must be one of {', '.join(LOOKUP_WALKS)}, got {lookup_walk!r}")
        self.lookup_walk = lookup_walk
        self._lock = threading.Lock()
        self._blocks: dict[bytes, set[str]] = {}
        """Device tier: block hash -> the workers holding it there."""
        self._host: dict[bytes, set[str]] = {}
        """Host tier: block hash -> the workers holding it there."""
        self._workers: dict[str, _Worker] = {}
        self._specs: dict[str, ModelSpec] = {}

    # -- helpers (lock held) -------------------------------------------------------------
    def _live(self, worker_id: str, now_ms: int) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None or w.lease_expiry_ms <= now_ms:
            raise refuse(Refusal.NOT_REGISTERED, worker_id)
        return w

    def _tier(self, w: _Worker, tier: Tier) -> tuple[OrderedDict[bytes, None], dict[bytes, set[str]]]:
        """A worker's LRU order and the holders map of ``tier`` (device or host)."""
        return (w.lru, self._blocks) if tier == Tier.DEVICE else (w.host, self._host)

    @staticmethod
    def _store(lru: OrderedDict[bytes, None], blocks: dict[bytes, set[str]], wid: str, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders = blocks.get(h)
                if holders is None:
                    blocks[h] = {wid}
                else:
                    holders.add(wid)

    @staticmethod
    def _remove(lru: OrderedDict[bytes, None], blocks: dict[bytes, set[str]], wid: str, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            if h in lru:
                del lru[h]
                holders = blocks.get(h)
                if holders is not None:
                    holders.discard(wid)
                    if not holders:
                        del blocks[h]

    def _clear(self, w: _Worker) -> int:
        n = len(w.lru) + len(w.host)
        wid = w.reg.worker_id
        self._remove(w.lru, self._blocks, wid, list(w.lru))
        self._remove(w.host, self._host, wid, list(w.host))
        return n

    def _cap(self, w: _Worker) -> None:
        wid = w.reg.worker_id
        for lru, blocks, cap in ((w.lru, self._blocks, w.reg.num_blocks), (w.host, self._host, w.reg.host_cap)):
            excess = len(lru) - cap
            if excess > 0:
                it = iter(lru)
                self._remove(lru, blocks, wid, [next(it) for _ in range(excess)])

    def _check_order(self, w: _Worker, epoch: int, seq: int) -> PublishResult | None:
        cur = w.reg.epoch
        if epoch < cur:
            raise refuse(Refusal.STALE_EPOCH, w.reg.worker_id, epoch=epoch, live=cur)
        if epoch == cur and seq <= w.last_seq:
            raise refuse(Refusal.SEQ_REGRESSION, w.reg.worker_id, seq=seq, live=w.last_seq)
        if epoch > cur:
            return PublishResult(Action.RESYNC, f"new epoch {epoch} (live epoch {cur}); send a snapshot")
        if seq != w.last_seq + 1:
            return PublishResult(Action.RESYNC, f"seq gap: expected {w.last_seq + 1}, got {seq}; send a snapshot")
        return None

    def _set_load(self, w: _Worker, load: Load, now_ms: int) -> None:
        """Records a report and retires the picks it covers (store_redis: common.lua cover_picks)."""
        w.load = dataclasses.replace(load, admitted=()) if load.admitted else load
        picks = w.picks
        if not picks:
            return
        cfg = self.pending_config
        if load.reports_admissions:
            for rid in load.admitted:
                picks.pop(rid, None)
            self._expire_picks(w, now_ms - cfg.ttl_ms)
        else:
            self._expire_picks(w, max(now_ms - cfg.ttl_ms, now_ms - cfg.grace_ms))

    @staticmethod
    def _expire_picks(w: _Worker, cutoff_ms: int) -> None:
        """Drops the picks taken at or before ``cutoff_ms`` (oldest first: they lead the dict)."""
        picks = w.picks
        while picks:
            rid, p = next(iter(picks.items()))
            if p[0] > cutoff_ms:
                break
            del picks[rid]

    @staticmethod
    def _pending(w: _Worker) -> Pending:
        picks = w.picks
        if not picks:
            return Pending(version=w.pick_version)
        return Pending(len(picks), sum(p[3] for p in picks.values()), sum(p[4] for p in picks.values()),
                       w.pick_version)

    def _remove_worker(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id)
        self._clear(w)
        model = w.reg.model_id
        if not any(o.reg.model_id == model for o in self._workers.values()):
            self._specs.pop(model, None)

    # -- interface -----------------------------------------------------------------------
    async def register_worker(self, reg: Registration, lease_ttl_ms: int, now_ms: int) -> None:
        with self._lock:
            spec = self._specs.get(reg.model_id)
            live_peers = [
                o for o in self._workers.values()
                if o.reg.model_id == reg.model_id and o.reg.worker_id != reg.worker_id and o.lease_expiry_ms > now_ms
            ]
            if spec and live_peers and (spec.block_size, spec.hash_algorithm) != (reg.block_size, reg.hash_algorithm):
                raise refuse(Refusal.SPEC, reg.worker_id, model_id=reg.model_id,
                             spec=(spec.block_size, spec.hash_algorithm), registered=(reg.block_size, reg.hash_algorithm))
            old = self._workers.get(reg.worker_id)
            if old is not None and old.lease_expiry_ms > now_ms:
                if old.reg.model_id != reg.model_id:
                    raise refuse(Refusal.MODEL, reg.worker_id, model_id=reg.model_id, other_model=old.reg.model_id)
                if reg.epoch < old.reg.epoch:
                    raise refuse(Refusal.STALE_REGISTRATION, reg.worker_id, epoch=reg.epoch, live=old.reg.epoch)
            if old is not None:
                self._remove_worker(reg.worker_id)
            self._specs[reg.model_id] = ModelSpec(reg.model_id, reg.block_size, reg.hash_algorithm)
            # NOTE: the picks died with the process; their count goes on, so a router's seen version
            # stays comparable.
            self._workers[reg.worker_id] = _Worker(reg, now_ms + lease_ttl_ms,
                                                   pick_version=old.pick_version if old is not None else 0)

    async def heartbeat(self, worker_id: str, epoch: int, load: Load, lease_ttl_ms: int, now_ms: int) -> bool:
        with self._lock:
            w = self._live(worker_id, now_ms)
            if epoch != w.reg.epoch:
                raise refuse(Refusal.HEARTBEAT_EPOCH, worker_id, epoch=epoch, live=w.reg.epoch)
            self._set_load(w, load, now_ms)
            w.lease_expiry_ms = now_ms + lease_ttl_ms
            return w.resync

    async def publish(self, worker_id: str, epoch: int, seq: int, events: list[KVCacheEvent], now_ms: int,
                      load: Load | None = None) -> PublishResult:
        with self._lock:
            w = self._live(worker_id, now_ms)
            resync = self._check_order(w, epoch, seq)
            if resync is not None:
                return resync
            if w.resync:
                return PublishResult(Action.RESYNC, FLUSHED + "; send a snapshot")
            wid = w.reg.worker_id
            for ev in events:
                if isinstance(ev, AllBlocksCleared):
                    self._clear(w)
                elif ev.tier in (Tier.DEVICE, Tier.HOST):  # NOTE: the disk tier is not kept (KVService counts it)
                    lru, blocks = self._tier(w, ev.tier)
                    (self._store if isinstance(ev, BlockStored) else self._remove)(lru, blocks, wid, ev.block_hashes)
            self._cap(w)
            w.last_seq = seq
            if load is not None:
                self._set_load(w, load, now_ms)
            return PublishResult(Action.ACK)

    async def snapshot(self, worker_id: str, epoch: int, seq: int, hashes: list[bytes], now_ms: int,
                       load: Load | None = None, host_hashes: Sequence[bytes] = ()) -> PublishResult:
        with self._lock:
            w = self._live(worker_id, now_ms)
            if epoch < w.reg.epoch:
                raise refuse(Refusal.STALE_EPOCH, worker_id, epoch=epoch, live=w.reg.epoch, snapshot=True)
            if epoch == w.reg.epoch and seq <= w.last_seq:
                raise refuse(Refusal.SEQ_REGRESSION, worker_id, seq=seq, live=w.last_seq, snapshot=True)
            # NOTE: only the difference touches the holder sets (a resync re-sends a whole cache
            # of which most is unchanged); the new set's order is the snapshot's.
            wid = w.reg.worker_id
            w.lru = self._replace(w.lru, self._blocks, wid, hashes)
            w.host = self._replace(w.host, self._host, wid, host_hashes)
            w.resync = False
            self._cap(w)
            if epoch != w.reg.epoch:
                w.reg = dataclasses.replace(w.reg, epoch=epoch)
            w.last_seq = seq
            if load is not None:
                self._set_load(w, load, now_ms)
            return PublishResult(Action.ACK)

    @staticmethod
    def _replace(old: OrderedDict[bytes, None], blocks: dict[bytes, set[str]], wid: str,
                 hashes: Sequence[bytes]) -> OrderedDict[bytes, None]:
        fresh: OrderedDict[bytes, None] = OrderedDict.fromkeys(hashes)
        for h in old:
            if h not in fresh:
                holders = blocks.get(h)
                if holders is not None:
                    holders.discard(wid)
                    if not holders:
                        del blocks[h]
        for h in fresh:
            if h not in old:
                blocks.setdefault(h, set()).add(wid)
        return fresh

    async def lookup(self, model_id: str, hashes: list[bytes], now_ms: int) -> list[WorkerMatch]:
        with self._lock:
            return self._lookup(model_id, hashes, now_ms)

    def _lookup(self, model_id: str, hashes: list[bytes], now_ms: int) -> list[WorkerMatch]:
        """Under self._lock."""
        live = {
            wid: w for wid, w in self._workers.items()
            if w.reg.model_id == model_id and w.lease_expiry_ms > now_ms
        }
        matched = dict.fromkeys(live, 0)
        blocks, host, n = self._blocks, self._host, len(hashes)
        if self.lookup_walk == "search":
            first = blocks.get(hashes[0], _NOBODY) if hashes else _NOBODY
            matched.update(search_prefixes(n, (wid for wid in first if wid in live),
                                           lambda at: [blocks.get(hashes[i], _NOBODY) for i in at]))
        else:
            candidates = set(live)
            for i, h in enumerate(hashes):
                candidates &= blocks.get(h, _NOBODY)
                if not candidates:
                    break
                for wid in candidates:
                    matched[wid] = i + 1
        reach: dict[str, int] = {}
        if host and hashes:
            # NOTE: the host tier's continuation: its blocks searched from each worker's device
            # answer on (prefix_search.continue_prefixes); nothing to search while no worker
            # holds a host-tier block.
            first_host = host.get(hashes[0], _NOBODY)
            if self.lookup_walk == "search":
                reach = continue_prefixes(n, {w: k for w, k in matched.items() if k},
                                          (wid for wid in first_host if wid in live),
                                          lambda at: [host.get(hashes[i], _NOBODY) for i in at])
            else:
                for wid in {w for w, k in matched.items() if k} | (first_host & live.keys()):
                    k = matched[wid]
                    reach[wid] = k + linear_prefix(n - k, lambda i, k=k, wid=wid: wid in host.get(
                        hashes[k + i], _NOBODY))
        return [
            WorkerMatch(wid, w.reg.address, matched[wid], w.load, w.reg.block_size, self._pending(w),
                        host_blocks=reach.get(wid, 0) and reach[wid] - matched[wid])
            for wid, w in live.items()
        ]

    async def reserve(self, res: Reservation, now_ms: int) -> ReservationAnswer:
        with self._lock:
            return self._reserve(res, now_ms)

    def _reserve(self, res: Reservation, now_ms: int) -> ReservationAnswer:
        """Under self._lock."""
        if res.release_worker_id:
            old = self._workers.get(res.release_worker_id)
            if old is not None:
                old.picks.pop(res.request_id, None)
        w = self._workers.get(res.worker_id)
        if w is None or w.lease_expiry_ms <= now_ms or w.reg.model_id != res.model_id:
            raise refuse(Refusal.NOT_LIVE_FOR_MODEL, res.worker_id, model_id=res.model_id)
        self._expire_picks(w, now_ms - self.pending_config.ttl_ms)  # NOTE: expired picks conflict with nobody
        seen = res.seen_version
        if seen is not None and any(v > seen and router != res.router_id for _, router, v, _, _ in w.picks.values()):
            model = w.reg.model_id
            return ReservationAnswer(False, {wid: self._pending(o) for wid, o in sorted(self._workers.items())
                                             if o.reg.model_id == model and o.lease_expiry_ms > now_ms})
        w.pick_version += 1
        w.picks.pop(res.request_id, None)  # NOTE: re-reserved: it moves to the end (newest)
        w.picks[res.request_id] = (now_ms, res.router_id, w.pick_version, res.prefill_tokens, res.blocks)
        while len(w.picks) > self.pending_config.max_per_worker:
            del w.picks[next(iter(w.picks))]
        return ReservationAnswer(True)

    async def holders(self, block_hash: bytes, now_ms: int, tier: Tier = Tier.DEVICE) -> list[str]:
        with self._lock:
            blocks = self._blocks if tier == Tier.DEVICE else self._host
            return sorted(
                wid for wid in blocks.get(block_hash, ()) if self._workers[wid].lease_expiry_ms > now_ms
            )

    async def workers(self, now_ms: int, include_expired: bool = False) -> list[WorkerInfo]:
        with self._lock:
            return [
                WorkerInfo(w.reg, w.last_seq, len(w.lru), w.load, w.lease_expiry_ms, self._pending(w), len(w.host))
                for wid, w in sorted(self._workers.items())
                if include_expired or w.lease_expiry_ms > now_ms
            ]

    async def stats(self, now_ms: int) -> IndexStats:
        with self._lock:
            live = [w for w in self._workers.values() if w.lease_expiry_ms > now_ms]
            models = [
                (spec, sum(1 for w in live if w.reg.model_id == m)) for m, spec in sorted(self._specs.items())
            ]
            return IndexStats(len(live), len(self._blocks), sum(len(w.lru) for w in self._workers.values()), models,
                              len(self._host), sum(len(w.host) for w in self._workers.values()))

    async def model_spec(self, model_id: str) -> ModelSpec | None:
        with self._lock:
            return self._specs.get(model_id)

    async def flush_worker(self, worker_id: str) -> int:
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None:
                raise refuse(Refusal.NOT_REGISTERED_ADMIN, worker_id)
            w.resync = True
            return self._clear(w)

    async def reap_expired(self, now_ms: int) -> int:
        with self._lock:
            dead = [wid for wid, w in self._workers.items() if w.lease_expiry_ms <= now_ms]
            for wid in dead:
                self._remove_worker(wid)
            return len(dead)

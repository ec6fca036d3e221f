"""``dynamo``: NVIDIA Dynamo's KV router, costed on the router's own active sequences.

Follows ai-dynamo/dynamo (read at these commits; no code of Dynamo is copied):

- ``lib/llm/src/kv_router/scheduler.rs`` @db19bd2a659d: ``DefaultWorkerSelector::select_worker``, ``softmax_sample``;
- ``lib/llm/src/kv_router/sequence.rs`` @581ee33e434f: ``ActiveSequences``, ``ActiveSequencesMultiWorker``,
  ``subscribe_to_events`` (replica sync), ``force_expiry``;
- ``lib/llm/src/kv_router/config.rs`` @0435b58a9c92: ``KvRouterConfig::default``;
- replica-sync batching: ``lib/llm/src/kv_router/sequence.rs`` @0266c3eba4f5 and
  ``lib/kv-router/src/sequences/replica_sync.rs`` @057096c31e3c;
- the cache tiers' credit: ``lib/kv-router/src/scheduling/selector/default.rs`` @07a6c9ce3bb0
  (``worker_logit``: ``overlap_credit_blocks = overlap_score_credit * device_overlap_blocks +
  host_cache_hit_weight * host_overlap_blocks + disk_cache_hit_weight * disk_overlap_blocks``,
  subtracted from the raw prefill blocks, floored at 0) and ``lib/kv-router/src/scheduling/config.rs``
  @07a6c9ce3bb0 (``default_host_cache_hit_weight`` 0.75, ``default_disk_cache_hit_weight`` 0.25); the
  host and disk overlaps are the lower tiers' extensions past the device prefix.

Per request, for every worker ``w`` (lowest wins; ``router_temperature`` 0)::

    overlap_w        = device_overlap_w + 0.75 * host_overlap_w
    prefill_blocks_w = (active_tokens_w + max(0, isl - overlap_w * bs)) / bs
    decode_blocks_w  = |unique_blocks_w| + #{h in this prompt's blocks : h not in unique_blocks_w}
    logit_w          = overlap_score_weight * prefill_blocks_w + decode_blocks_w

``device_overlap_w`` is the index's answer alone (Dynamo's overlap comes from its KV-event indexer,
not from its own picks), ``host_overlap_w`` the index's host continuation past it (kvmesh indexes no
disk tier, so Dynamo's 0.25 disk weight has nothing to weigh). ``unique_blocks_w`` is the refcounted set of the block hashes of the requests
the router sent to ``w`` and has not freed: a prefix shared by 16 requests in flight counts once,
and a request that shares it adds only its own suffix. ``active_tokens_w`` is the uncached prompt
tokens of those requests not yet past their first token. The worker's reported load is never read.

Lifecycle (``RouterPolicy`` hooks): *add* when the request is sent, with the chosen worker's overlap;
*prefill done* at its first token; *free* when it ends, however it ends. Every 300 s the requests
still active since the previous sweep are freed (Dynamo's ``force_expiry``: a lost free cannot
leak). With replica sync on (:meth:`DynamoPolicy.sync_replicas`, Dynamo's ``--router-replica-sync``)
the three events are published, batched by the driver (256 events or 1 ms), and applied by every
peer router to its own active sequences.

Deviations from Dynamo (docs/router.md, "Peers: what differs from the source"): ties are broken at
random (Dynamo: the worker whose indexer tree is smallest, then at random; kvmesh's Lookup does not
return a worker's indexed block count).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy

HOST_CACHE_HIT_WEIGHT = 0.75
"""Dynamo's ``host_cache_hit_weight``: a host-pinned block's credit, of a device block's."""
DISK_CACHE_HIT_WEIGHT = 0.25
"""Dynamo's ``disk_cache_hit_weight`` (kvmesh indexes no disk tier: unused here, kept with its source)."""


def overlap(c: Candidate) -> float:
    """Dynamo's overlap credit in blocks: the device overlap plus the host tier's extension, weighted."""
    return c.indexed_blocks + HOST_CACHE_HIT_WEIGHT * c.indexed_host_blocks


EXPIRY_S = 300.0
"""Dynamo's ``EXPIRY_DURATION``: a request still active after a full sweep period is freed."""

RequestKey = tuple[str, int]
"""(the router that sent it, its ticket serial there)."""


@dataclass(slots=True, frozen=True)
class ActiveSequenceEvent:
    """One change of a router's active sequences, as replica sync sends it to the peers."""

    router: str
    serial: int
    worker_id: str
    kind: str
    """``add``, ``prefilled`` or ``free``."""
    block_hashes: Sequence[bytes] = ()
    """add: the request's full-block hashes."""
    prefill_tokens: int = 0
    """add: its uncached prompt tokens on the worker (isl - overlap * block size)."""


class _WorkerSequences:
    __slots__ = ("blocks", "prefill", "active_tokens")

    def __init__(self) -> None:
        self.blocks: dict[bytes, int] = {}
        """block hash -> requests holding it (the unique set is the keys)."""
        self.prefill: dict[RequestKey, int] = {}
        """request -> its uncached prompt tokens, until its first token."""
        self.active_tokens = 0


class ActiveSequences:
    """Per worker, the requests routed there and not freed: their blocks as a refcounted set and the
    prefill tokens of those not yet prefilled (Dynamo's ``ActiveSequences``). Bounded: a worker with
    nothing active has no entry, and every request is freed at the latest two expiry periods after it
    was added. Not thread-safe."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerSequences] = {}
        self._requests: dict[RequestKey, tuple[str, Sequence[bytes]]] = {}
        self._expiry_at: float | None = None
        self._expiring: dict[RequestKey, None] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def view(self, worker_id: str, block_hashes: Sequence[bytes]) -> tuple[int, int, int]:
        """(unique active blocks, active prefill tokens, blocks of ``block_hashes`` not active) on the worker."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0, 0, len(block_hashes)
        blocks = w.blocks
        new = sum(1 for h in block_hashes if h not in blocks)
        return len(blocks), w.active_tokens, new

    def add(self, key: RequestKey, worker_id: str, block_hashes: Sequence[bytes], prefill_tokens: int,
            now: float) -> None:
        self._expire(now)
        if key in self._requests:
            return
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _WorkerSequences()
        blocks = w.blocks
        for h in block_hashes:
            blocks[h] = blocks.get(h, 0) + 1
        w.prefill[key] = prefill_tokens
        w.active_tokens += prefill_tokens
        self._requests[key] = (worker_id, block_hashes)

    def prefilled(self, key: RequestKey) -> None:
        entry = self._requests.get(key)
        if entry is None:
            return
        w = self._workers.get(entry[0])
        if w is None:  # NOTE: see free(): a request with no blocks and no prefill left adds nothing
            return
        tokens = w.prefill.pop(key, None)
        if tokens is not None:
            w.active_tokens -= tokens

    def free(self, key: RequestKey) -> None:
        entry = self._requests.pop(key, None)
        if entry is None:
            return
        self._expiring.pop(key, None)
        worker_id, block_hashes = entry
        w = self._workers.get(worker_id)
        if w is None:
            # NOTE: a worker's entry goes when it holds no block and no prefill; a request of a
            # prompt shorter than one block, already prefilled, was still active there and
            # weighs nothing (the KeyError the synthetic trace hit with 64-token blocks).
            return
        tokens = w.prefill.pop(key, None)
        if tokens is not None:
            w.active_tokens -= tokens
        blocks = w.blocks
        for h in block_hashes:
            n = blocks[h] - 1
            if n:
                blocks[h] = n
            else:
                del blocks[h]
        if not blocks and not w.prefill:
            del self._workers[worker_id]

    def _expire(self, now: float) -> None:
        """Dynamo's ``force_expiry``: at each sweep, free what was already active at the previous one."""
        if self._expiry_at is None:
            self._expiry_at = now + EXPIRY_S
            return
        if now < self._expiry_at:
            return
        for key in list(self._expiring):
            self.free(key)
        self._expiry_at = now + EXPIRY_S
        self._expiring = dict.fromkeys(self._requests)


class DynamoPolicy(RouterPolicy):
    """Dynamo's KV router cost on its active sequences (module docstring); lowest logit wins."""

    name = "dynamo"
    uses_index = True
    replica_sync = True
    replica_batch: ClassVar[tuple[float, int]] = (0.001, 256)
    """(seconds, events): a router sends its replica events at most this long after the first of a batch,
    or as soon as this many are waiting (Dynamo's ``MAX_REPLICA_BATCH_DURATION``, ``_EVENTS``)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.sequences = ActiveSequences()
        self.replica_id = ""
        self._publish: Callable[[object], None] | None = None

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        bs = query.block_size or 1
        weight = self.config.overlap_weight
        with self._lock:
            logits = []
            for c in candidates:
                active_blocks, active_tokens, new_blocks = self.sequences.view(c.worker_id, query.block_hashes)
                prefill_tokens = active_tokens + max(0, round(query.prompt_len - overlap(c) * bs))
                logits.append(weight * prefill_tokens / bs + active_blocks + new_blocks)
            best = min(logits)
            tied = [i for i, v in enumerate(logits) if v == best]
            # NOTE: Dynamo breaks a tie by the smallest indexer tree first; kvmesh's Lookup does not
            # return a worker's block count, so it is random here (docs/router.md, deviations).
            i = tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
        chosen = candidates[i]
        return Decision(chosen.worker_id, "prefix" if chosen.indexed_blocks or chosen.indexed_host_blocks else "load",
                        round(best))

    # -- the active sequences: this router's requests ----------------------------------------------
    def started(self, ticket: Ticket, query: RouteQuery, chosen: Candidate) -> None:
        prefill = max(0, round(query.prompt_len - overlap(chosen) * query.block_size))
        self._apply(ActiveSequenceEvent(self.replica_id, ticket.serial, ticket.worker_id, "add",
                                        query.block_hashes, prefill), publish=True)

    def prefilled(self, ticket: Ticket) -> None:
        self._apply(ActiveSequenceEvent(self.replica_id, ticket.serial, ticket.worker_id, "prefilled"), publish=True)

    def finished(self, ticket: Ticket, output_tokens: int) -> None:
        self._apply(ActiveSequenceEvent(self.replica_id, ticket.serial, ticket.worker_id, "free"), publish=True)

    # -- replica sync: the peers' requests --------------------------------------------------------
    def sync_replicas(self, replica_id: str, publish: Callable[[object], None]) -> None:
        self.replica_id = replica_id
        self._publish = publish

    def apply_replica_events(self, events: Sequence[object]) -> None:
        for e in events:
            assert isinstance(e, ActiveSequenceEvent)
            if e.router != self.replica_id:  # NOTE: a router skips its own events (subscribe_to_events)
                self._apply(e, publish=False)

    def _apply(self, e: ActiveSequenceEvent, publish: bool) -> None:
        key = (e.router, e.serial)
        with self._lock:
            if e.kind == "add":
                self.sequences.add(key, e.worker_id, e.block_hashes, e.prefill_tokens, self.config.clock())
            elif e.kind == "prefilled":
                self.sequences.prefilled(key)
            else:
                self.sequences.free(key)
        if publish and self._publish is not None:
            self._publish(e)

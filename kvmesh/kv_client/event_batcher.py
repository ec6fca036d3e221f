"""What a worker's next event message to the kv_service carries, and when it may go.

A pure accumulator: it owns no clock, thread, stream or error policy (Dynamo's publisher batching
core makes the same cut), so the live publisher (kvmesh/kv_client/publisher.py: threads, gRPC)
and the simulator's workers (kvmesh/sim/mesh.py: a virtual clock) drive the one code:

- block events of every engine step are queued and go out merged, at most one message every
  ``interval_s``: a busy worker steps hundreds of times a second, and one message (one Redis
  script) per step would load the kv_service for nothing;
- every message is numbered (``seq``, from 1 in each registration) and carries the worker's load
  as it goes; when the load's routing state changed and no events are queued, the load goes out
  alone in the next slot (routers see a worker's queue as fresh as the event stream);
- a RESYNC (or a queue past ``max_queued`` batches) drops the queued events: the next message is a
  snapshot of the cached blocks, which replaces every event before it;
- a registration starts a new epoch: seq from 0, and its first message is all-cleared.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvmesh.contract.types import AllBlocksCleared, KVCacheEvent, Load

BATCH_INTERVAL_S = 0.02
"""At most one message per worker this often."""
MAX_QUEUED_BATCHES = 1024
"""Queued step batches past which the queue collapses into a snapshot (the kv_service is not keeping up)."""


@dataclass(slots=True)
class Message:
    """One message of a worker's event stream."""

    seq: int
    events: list[KVCacheEvent] = field(default_factory=list)
    snapshot: list[bytes] | None = None
    """The worker's cached blocks, oldest first: the message replaces the worker's set (no events)."""
    load: Load | None = None
    host_snapshot: list[bytes] = field(default_factory=list)
    """With ``snapshot``: the blocks of the worker's host KV tier, oldest first."""


class EventBatcher:
    """Args:
    interval_s: the least time between two messages.
    max_queued: queued step batches past which the queue is dropped for a snapshot.
    load_reports: messages carry the load, and a changed load goes out alone (the live worker);
        False = events only (the simulator's ``--load-reports heartbeat``).
    """

    def __init__(self, interval_s: float = BATCH_INTERVAL_S, max_queued: int = MAX_QUEUED_BATCHES,
                 load_reports: bool = True) -> None:
        self.interval_s = interval_s
        self.max_queued = max_queued
        self.load_reports = load_reports
        self.seq = 0
        self.need_snapshot = False
        self._queued: list[list[KVCacheEvent]] = []
        self._sent_state: tuple[int, ...] | None = None
        self._last_sent = -math.inf

    def register(self) -> None:
        """A new registration (epoch): numbering restarts and the index starts empty, so its first
        message is all-cleared; events queued before it (a source that ran before the kv_service
        answered) follow it."""
        self.seq = 0
        self._queued.insert(0, [AllBlocksCleared()])

    def restart_numbering(self) -> None:
        """The registration was renewed (the lease had lapsed): numbering restarts; a snapshot must
        follow (the caller asks for one)."""
        self.seq = 0

    def add(self, events: list[KVCacheEvent]) -> bool:
        """One step's events; False when they were dropped (a snapshot is owed, or the queue was
        full and now owes one)."""
        if self.need_snapshot:
            return False  # the coming snapshot supersedes these
        if len(self._queued) >= self.max_queued:
            self.resync()
            return False
        self._queued.append(events)
        return True

    def resync(self) -> None:
        """The index must get a snapshot: the queued events are dropped."""
        self._queued.clear()
        self.need_snapshot = True

    @property
    def has_events(self) -> bool:
        return bool(self._queued)

    def next_due(self) -> float:
        """When the next message may go (the caller's clock)."""
        return self._last_sent + self.interval_s

    def load_changed(self, load: Load | None) -> bool:
        """Whether ``load`` would go out alone (its routing state differs from the last one sent)."""
        return (self.load_reports and load is not None and not self.need_snapshot
                and load.queue_state() != self._sent_state)

    def take(self, now: float, load: Load | None = None) -> Message | None:
        """The next event message at ``now`` (the caller waited for :meth:`next_due`): every queued
        event, in order, or the load alone when it changed; None when there is nothing to send."""
        if self.need_snapshot:
            return None
        load = load if self.load_reports else None
        if not self._queued and not self.load_changed(load):
            return None
        events = [e for batch in self._queued for e in batch]
        self._queued.clear()
        return self._stamp(now, Message(0, events, None, load))

    def take_snapshot(self, now: float, hashes: list[bytes], load: Load | None = None,
                      host_hashes: list[bytes] | None = None) -> Message:
        """The snapshot owed (or wanted at once): it replaces every queued event. ``hashes`` are the
        device's blocks, ``host_hashes`` the host tier's (each oldest first)."""
        self.need_snapshot = False
        self._queued.clear()
        return self._stamp(now, Message(0, [], hashes, load if self.load_reports else None, host_hashes or []))

    def _stamp(self, now: float, msg: Message) -> Message:
        self.seq += 1
        msg.seq = self.seq
        self._last_sent = now
        if msg.load is not None:
            self._sent_state = msg.load.queue_state()
        return msg

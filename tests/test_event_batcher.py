"""The event batching core (kvmesh/kv_client/event_batcher.py) the live publisher and the simulator
both drive: numbering, pacing, merging, load-only messages, snapshots replacing queued events."""

from __future__ import annotations

from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, Load
from kvmesh.kv_client.event_batcher import EventBatcher

A, B, C = BlockStored([b"a" * 16]), BlockStored([b"b" * 16]), BlockRemoved([b"a" * 16])


def load(running: int, waiting: int = 0) -> Load:
    return Load(num_running=running, num_waiting=waiting)


def test_a_registration_starts_with_all_cleared_then_merged_events_numbered_as_sent():
    b = EventBatcher(interval_s=0.02)
    b.add([A])  # before the kv_service answered: kept, after the all-cleared
    b.register()
    b.add([B])
    m = b.take(0.0, load(1))
    assert (m.seq, m.events, m.snapshot, m.load) == (1, [AllBlocksCleared(), A, B], None, load(1))
    assert b.next_due() == 0.02 and b.take(0.03, load(1)) is None  # nothing new, load unchanged
    b.add([C])
    b.add([A])
    m = b.take(0.05, load(1))
    assert (m.seq, m.events) == (2, [C, A])


def test_a_changed_load_goes_out_alone_unless_reports_are_off():
    b = EventBatcher()
    b.register()
    b.take(0.0, load(0))
    assert b.load_changed(load(0)) is False and b.take(0.1, load(0)) is None
    assert b.load_changed(load(0, 3)) and b.take(0.2, load(0, 3)).events == []
    off = EventBatcher(load_reports=False)
    off.register()
    m = off.take(0.0, load(5))
    assert m.load is None and off.take(0.1, load(7)) is None


def test_a_resync_drops_queued_events_and_the_snapshot_replaces_them():
    b = EventBatcher()
    b.register()
    b.take(0.0)
    b.add([A])
    b.resync()
    assert b.need_snapshot and b.add([B]) is False and b.take(1.0, load(2)) is None
    m = b.take_snapshot(1.0, [b"x" * 16], load(2))
    assert (m.seq, m.snapshot, m.events, b.need_snapshot) == (2, [b"x" * 16], [], False)
    b.restart_numbering()  # the lease had lapsed: a new registration numbers from 1 again
    assert b.take_snapshot(2.0, []).seq == 1


def test_a_full_queue_collapses_into_a_snapshot():
    b = EventBatcher(max_queued=2)
    b.register()  # the all-cleared is one queued batch
    assert b.add([A]) is True and b.add([B]) is False and b.need_snapshot and not b.has_events

"""The speculative map: leading matches per worker, TTL expiry on an injected clock, bound."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.router.core.speculative import SpeculativeIndex


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


CHAIN = [hashlib.sha256(bytes([i])).digest()[:16] for i in range(8)]
OTHER = [hashlib.sha256(bytes([100 + i])).digest()[:16] for i in range(8)]


def test_leading_matches_per_worker():
    idx = SpeculativeIndex(ttl_s=2.0, clock=Clock())
    idx.record(CHAIN[:6], "w1")
    idx.record(CHAIN[:2], "w2")
    idx.record(OTHER, "w3")
    assert idx.matches(CHAIN) == {"w1": 6, "w2": 2}
    assert idx.matches(CHAIN[:3]) == {"w1": 3, "w2": 2}
    assert idx.matches(OTHER[:4]) == {"w3": 4}
    assert idx.matches([]) == {}


def test_entries_expire_after_ttl_and_rerecord_extends():
    clock = Clock()
    idx = SpeculativeIndex(ttl_s=2.0, clock=clock)
    idx.record(CHAIN[:4], "w1")
    clock.t += 1.0
    idx.record(CHAIN[:2], "w1")  # blocks 0-1 now live until t+3
    clock.t += 0.999
    assert idx.matches(CHAIN) == {"w1": 4}
    clock.t += 0.001  # exactly 2 s after the first record
    assert idx.matches(CHAIN) == {"w1": 2}
    clock.t += 1.0
    assert idx.matches(CHAIN) == {}
    idx.record(OTHER[:1], "w2")  # a record sweeps expired entries
    assert len(idx) == 1


def test_bounded_oldest_record_dropped_whole_and_zero_ttl_is_off():
    clock = Clock()
    idx = SpeculativeIndex(ttl_s=5.0, max_entries=6, clock=clock)
    idx.record(CHAIN[:4], "w1")
    clock.t += 0.5
    idx.record(OTHER[:4], "w2")
    # The oldest record (w1's 4 blocks) went whole: a part of it could leave a hole mid-chain.
    assert (len(idx), idx.matches(CHAIN), idx.matches(OTHER)) == (4, {}, {"w2": 4})
    clock.t += 0.5
    idx.record(CHAIN[:8], "w3")  # over the bound alone: its leading 6 blocks are kept
    assert (len(idx), idx.matches(CHAIN), idx.matches(OTHER)) == (6, {"w3": 6}, {})
    off = SpeculativeIndex(ttl_s=0.0)
    off.record(CHAIN, "w1")
    assert (len(off), off.matches(CHAIN)) == (0, {})
    with pytest.raises(ValueError, match="speculative TTL must be >= 0"):
        SpeculativeIndex(ttl_s=-1)


def test_equal_expiry_records_of_one_worker_drop_together():
    """Issue 29: two records with one expiry, the second a prefix of the first (a burst decided at
    one instant); the first's drop emptied the worker's map and the second's raised KeyError."""
    clock = Clock()
    idx = SpeculativeIndex(ttl_s=2.0, clock=clock)
    idx.record(CHAIN[:2], "w")
    idx.record(CHAIN[:1], "w")
    clock.t += 5.0
    idx.record(OTHER[:1], "w")
    assert (len(idx), idx.matches(CHAIN), idx.matches(OTHER)) == (1, {}, {"w": 1})


def test_bound_drops_every_record_of_the_oldest_instant():
    """Two workers' records at one instant share a prefix; dropping only one of them would leave
    w2's chain with a hole at blocks 0-1 and a tail the bisection would still count."""
    clock = Clock()
    idx = SpeculativeIndex(ttl_s=5.0, max_entries=9, clock=clock)
    idx.record(CHAIN[:3], "w1")
    idx.record(CHAIN[:2], "w1")
    idx.record(CHAIN[:5], "w2")
    clock.t += 0.1
    idx.record(OTHER[:2], "w3")
    assert (len(idx), idx.matches(CHAIN), idx.matches(OTHER)) == (2, {}, {"w3": 2})

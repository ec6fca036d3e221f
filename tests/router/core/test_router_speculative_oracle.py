"""The speculative map against a plain oracle: a dict (block, worker) -> expiry.

Random sequences of record / matches / len / clock steps, with equal clock values (bursts decided
at one instant), chains that are prefixes and repeats of each other, several workers and tiny
``max_entries``. After every operation the map and the oracle agree on ``matches`` and ``len``.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.router.core.speculative import SpeculativeIndex

TTL = 2.0
WORKERS = ("w0", "w1", "w2")


def chain_of(tokens: list[int]) -> list[bytes]:
    """Chained hashes: block i's identity is the whole path to it (so chains form a trie)."""
    return [bytes(tokens[: i + 1]) for i in range(len(tokens))]


class Oracle:
    """What the map means: entries live TTL seconds from their latest record; over the bound, every
    entry carrying the oldest expiry goes; a record keeps at most ``max_entries`` leading blocks."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.expiry: dict[tuple[bytes, str], float] = {}

    def _expire(self, now: float) -> None:
        self.expiry = {k: e for k, e in self.expiry.items() if e > now}

    def record(self, chain: list[bytes], worker: str, now: float) -> None:
        if not chain:
            return
        self._expire(now)
        for h in chain[: self.max_entries]:
            self.expiry[(h, worker)] = now + TTL
        while len(self.expiry) > self.max_entries:
            oldest = min(self.expiry.values())
            self.expiry = {k: e for k, e in self.expiry.items() if e != oldest}

    def matches(self, chain: list[bytes], now: float) -> dict[str, int]:
        out = {}
        for w in WORKERS:
            n = 0
            while n < len(chain) and self.expiry.get((chain[n], w), 0.0) > now:
                n += 1
            if n:
                out[w] = n
        return out

    def size(self, now: float) -> int:
        self._expire(now)
        return len(self.expiry)


tokens = st.lists(st.integers(0, 2), min_size=0, max_size=6)
ops = st.lists(st.one_of(
    st.tuples(st.just("record"), tokens, st.sampled_from(WORKERS)),
    st.tuples(st.just("matches"), tokens),
    st.tuples(st.just("len")),
    # NOTE: mostly 0 (equal clock values), sometimes exactly the TTL, sometimes a fraction of it.
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.0, 0.0, 0.25, 0.5, 1.0, TTL, 3.0])),
), max_size=60)


@settings(max_examples=400, deadline=None)
@given(ops=ops, max_entries=st.integers(1, 12))
def test_speculative_map_agrees_with_oracle(ops, max_entries):
    now = [10.0]
    idx = SpeculativeIndex(ttl_s=TTL, max_entries=max_entries, clock=lambda: now[0])
    oracle = Oracle(max_entries)
    for op in ops:
        if op[0] == "record":
            chain = chain_of(op[1])
            idx.record(chain, op[2])
            oracle.record(chain, op[2], now[0])
        elif op[0] == "matches":
            chain = chain_of(op[1])
            assert idx.matches(chain) == oracle.matches(chain, now[0])
        elif op[0] == "tick":
            now[0] += op[1]
        assert len(idx) == oracle.size(now[0])
        # Every chain the oracle knows of, from every root: the bisection must agree everywhere.
        for key in list(oracle.expiry):
            chain = chain_of(list(key[0]))
            assert idx.matches(chain) == oracle.matches(chain, now[0])

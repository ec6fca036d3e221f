"""How many leading blocks of a chain each worker holds, in O(log n) probes instead of a walk.

The prefix invariant (docs/kv-service.md "Lookup"): a worker's blocks are closed under parent.
Stores arrive parent-first and evictions leaf-first (kvmesh's block pool, vLLM's and SGLang's free
a request's blocks tail-first), and a block hash names its whole prefix, so along any chain
``held(i)`` is true for i < k and false from k on. Then k is found by a binary search on ``held``.

Every worker runs the same deterministic search (:func:`held_prefix`); what it answers is a
function of that worker's blocks only, whoever else holds what and however the workers are sharded:

- where the invariant holds along the chain: the first block the worker misses (the linear walk's
  answer, :func:`linear_prefix`);
- always: 0 if the worker lacks block 0; else some k >= the linear answer with ``held(k - 1)`` and
  (k < n) ``not held(k)``: the end of a run of held blocks. A worker that broke the invariant (a lost
  removal capped by the index's LRU order, an engine whose events arrive out of order) can be
  credited with blocks past a hole in its prefix; it never gets fewer than the walk gives it.

Both stores run it: the memory store with :func:`search_prefixes`, the Redis store in Lua
(kv_service/lua/lookup.lua) with the same probes in the same order. This module imports neither
grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


def midpoint(lo: int, hi: int) -> int:
    """The next candidate answer of the search over ``[lo, hi]`` (lo < hi): its upper middle."""
    return (lo + hi + 1) // 2


def held_prefix(n: int, held: Callable[[int], bool]) -> int:
    """One worker's answer for a chain of ``n`` blocks; ``held(i)``: it holds block i (0-based).

    NOTE: block 0 first (a worker without it matches nothing: most workers, one probe), then a
    binary search over [1, n] that keeps two facts: held(lo - 1), and hi == n or not held(hi).
    When lo == hi, both hold of one k: the end of a run of held blocks.
    """
    if n == 0 or not held(0):
        return 0
    lo, hi = 1, n
    while lo < hi:
        mid = midpoint(lo, hi)
        if held(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def linear_prefix(n: int, held: Callable[[int], bool]) -> int:
    """The walk's answer: the first block the worker misses (n: none). The reference of the tests
    and of ``--lookup-walk linear``."""
    for i in range(n):
        if not held(i):
            return i
    return n


def search_prefixes(n: int, holders_of_first: Iterable[T],
                    holders_at: Callable[[Sequence[int]], Sequence[Collection[T]]]) -> dict[T, int]:
    """:func:`held_prefix` for many workers at once, sharing probes.

    Args:
        n: blocks in the chain.
        holders_of_first: the workers (of interest) holding block 0; every other one answers 0.
        holders_at: the holders of each of several blocks (by position), asked once per round.

    Workers that agreed on every probe so far are one group with one next probe, so a round asks
    one block per group and there are about log2(n) rounds. Returns the answer of every worker of
    ``holders_of_first`` (all >= 1).
    """
    first = list(holders_of_first)
    done: dict[T, int] = {}
    if not first or n == 0:
        return done
    groups: list[tuple[int, int, list[T]]] = [(1, n, first)]
    while groups:
        open_ = [g for g in groups if g[0] < g[1]]
        for lo, hi, members in groups:
            if lo == hi:
                done.update(dict.fromkeys(members, lo))
        if not open_:
            break
        found = holders_at([midpoint(lo, hi) - 1 for lo, hi, _ in open_])
        groups = []
        for (lo, hi, members), holders in zip(open_, found, strict=True):
            mid = midpoint(lo, hi)
            right = [w for w in members if w in holders]
            left = [w for w in members if w not in holders] if len(right) < len(members) else []
            if right:
                groups.append((mid, hi, right))
            if left:
                groups.append((lo, mid - 1, left))
    return done

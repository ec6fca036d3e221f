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
(kv_service/lua/lookup.lua) with the same probes in the same order.

**The host tier's continuation** (:func:`continued_prefix`): the same search over the blocks a
worker holds in its host tier, over [d, n] where its device answer ``d`` ended (from scratch when
``d`` is 0). Its answer ``u >= d`` ends a run of host blocks (or is ``d``) at or past the walk
from ``d`` (the first block from ``d`` on that the host tier misses); ``u - d`` is what a Lookup
reports as the host continuation, the blocks the worker would load back instead of recompute (its
own admission walks exactly that far, model_worker/scheduling/host_block_pool.py ``find_run``).

It is the walk's answer, the longest prefix held in either tier less ``d``, while the worker's
blocks are prefix-closed on its device and in the union of its tiers: then no device block of the
chain lies past ``d``, so from ``d`` on the union is the host tier, held then not. The union is
closed because the host tier fills at device eviction (leaf-first: a parent reaches it no earlier
than its children), evicts least recently used first (children first), and a loaded block is on
the device again; docs/kv-service.md says where it breaks. A worker with no host-tier block always
gets 0. This module imports neither grpc nor redis.
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
    return _search(1, n, held)


def _search(lo: int, hi: int, held: Callable[[int], bool]) -> int:
    while lo < hi:
        mid = midpoint(lo, hi)
        if held(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def continued_prefix(n: int, start: int, held: Callable[[int], bool]) -> int:
    """The host tier's reach for a worker whose device answer was ``start``; ``held(i)``: its host
    tier holds block i. :func:`held_prefix` when ``start`` is 0, else the same binary search over
    [start, n] (block ``start - 1`` is the device's: the search assumes it held)."""
    return held_prefix(n, held) if start == 0 else _search(start, n, held)


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
    if not first or n == 0:
        return {}
    return search_runs([(1, n, first)], holders_at)


def continue_prefixes(n: int, device: dict[T, int], holders_of_first: Iterable[T],
                      holders_at: Callable[[Sequence[int]], Sequence[Collection[T]]]) -> dict[T, int]:
    """:func:`continued_prefix` for many workers at once, sharing probes.

    Args:
        n: blocks in the chain.
        device: each worker's device answer (:func:`search_prefixes`; workers without block 0 may be absent).
        holders_of_first: the workers (of interest) holding block 0 in their host tier.
        holders_at: the host tier's holders of each of several blocks (by position).

    Returns the reach of every worker of ``device`` with an answer above 0 or of ``holders_of_first``
    (each >= its device answer).
    """
    if n == 0:
        return {}
    starts: dict[int, list[T]] = {}
    for w, d in device.items():
        if d:
            starts.setdefault(d, []).append(w)
    for w in holders_of_first:
        if not device.get(w):
            starts.setdefault(1, []).append(w)
    return search_runs([(lo, n, members) for lo, members in starts.items()], holders_at)


def search_runs(groups: list[tuple[int, int, list[T]]],
                holders_at: Callable[[Sequence[int]], Sequence[Collection[T]]]) -> dict[T, int]:
    """The binary search of :func:`held_prefix` from several states at once: each group
    ``(lo, hi, members)`` has every member holding block ``lo - 1`` and (``hi`` < n) not block
    ``hi``; one round asks one block per open group. Returns each member's answer."""
    done: dict[T, int] = {}
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

"""kv-aware and the prefixes it routes over time (router/core/policies/prefix_load.py, issue 42).

Scenarios on the routing core alone: four identical workers whose step cost the policy has learned
(a linear cost it recovers exactly), the requests it routes counted through its own hooks as the live
router and the simulator count them (started at the pick, finished at the end).
"""

from __future__ import annotations

import hashlib
from itertools import count

from kvmesh.contract.index_protocol import Pending
from kvmesh.contract.types import Load
from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy
from tests.support.step_cost import linear_reports

BS = 16
PREFIX = 256
"""Blocks of the shared prefix (4,096 tokens)."""
OWN = 4
"""Blocks of each request's own question (64 tokens)."""
TOTAL_BLOCKS = 10_000
COST = dict(step_s=0.002, prefill_token_s=40e-6, prefill_pair_s=0.0, decode_seq_s=50e-6, decode_context_token_s=0.0)
WORKERS = ("w0", "w1", "w2", "w3")
_serials = count(1)


def block(tag: str, i: int) -> bytes:
    return hashlib.sha256(f"{tag}:{i}".encode()).digest()[:16]


def query(prefix: str, tail: int) -> RouteQuery:
    """A prompt of the ``prefix`` family's PREFIX blocks and OWN blocks of its own (``tail`` tells them apart)."""
    chain = [block(prefix, i) for i in range(PREFIX)] + [block(f"{prefix}/{tail}", i) for i in range(OWN)]
    return RouteQuery((PREFIX + OWN) * BS, BS, chain, True, 64)


def learned_policy() -> KvAwarePolicy:
    """kv-aware with COST learned for every worker (varied steps, exact busy seconds)."""
    p = KvAwarePolicy(PolicyConfig(seed=0))
    for seed, w in enumerate(WORKERS):
        for load in linear_reports(COST, 12, seed):
            p.cost.observe(w, load)
    assert p.cost.learned
    return p


def cand(wid: str, matched: int = 0, queued: int = 0, cached: int = 0) -> Candidate:
    """A worker with ``queued`` prompt tokens waiting, ``cached`` of its blocks holding prefixes."""
    return Candidate(wid, f"{wid}:1", matched, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                                      num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=queued,
                                                      num_cached_blocks=cached))


def start(p: KvAwarePolicy, q: RouteQuery, c: Candidate) -> Ticket:
    """The request goes to ``c`` (the core's RoutingCore.start, as far as the policy sees it)."""
    t = Ticket(c.worker_id, q.prompt_len - c.matched_blocks * BS, serial=next(_serials))
    p.started(t, q, c)
    return t


class Fleet:
    """The four workers as the router sees them: who holds which prefix, the prompt tokens queued at
    each (a request's uncached tokens until it finishes), whose KV is full."""

    def __init__(self, policy: KvAwarePolicy) -> None:
        self.p = policy
        self.holds: dict[str, set[str]] = {w: set() for w in WORKERS}
        self.queued = dict.fromkeys(WORKERS, 0)
        self.full: set[str] = set()
        self.live: list[tuple[Ticket, str, int]] = []
        self.tails = count()

    def route(self, prefix: str) -> str:
        q = query(prefix, next(self.tails))
        cands = [cand(w, PREFIX if prefix in self.holds[w] else 0, self.queued[w],
                      TOTAL_BLOCKS if w in self.full else 0) for w in WORKERS]
        chosen = next(c for c in cands if c.worker_id == self.p.pick(q, cands).worker_id)
        t = start(self.p, q, chosen)
        new = q.prompt_len - chosen.matched_blocks * BS
        self.queued[chosen.worker_id] += new
        self.holds[chosen.worker_id].add(prefix)
        self.live.append((t, chosen.worker_id, new))
        return chosen.worker_id

    def finish_all(self) -> None:
        for t, w, new in self.live:
            self.p.finished(t, 64)
            self.queued[w] -= new
        self.live.clear()


def test_free_kv_changes_the_price_of_a_hot_prefix_copy_and_full_kv_does_not():
    """w0 holds the prefix with 6,000 tokens queued: waiting there (0.24 s) beats recomputing the
    prefix on an idle worker (0.17 s) plus the work it adds to the mesh, unless the prefix is hot (its
    requests in flight outgrow one worker) and the copy lands in free KV: then the copy is load."""
    q = query("p", 0)

    def setup(hot: bool, full: bool) -> tuple[KvAwarePolicy, list[Candidate]]:
        p = learned_policy()
        if hot:
            for _ in range(30):  # 30 of this router's requests in flight share the prefix
                start(p, q, cand("w0", PREFIX))
        return p, [cand("w0", PREFIX, queued=6000)] + [cand(w, cached=TOTAL_BLOCKS if full else 0) for w in WORKERS[1:]]

    def picked(hot: bool, full: bool) -> str:
        p, cands = setup(hot, full)
        return p.pick(q, cands).worker_id

    def scores(hot: bool, full: bool) -> dict[str, float]:
        p, cands = setup(hot, full)
        return dict(zip(WORKERS, p.scores(q, cands), strict=True))

    assert picked(False, False) == "w0"  # a cold prefix stays where it is
    copy = picked(True, False)
    assert copy != "w0"  # a hot one takes a copy on free KV (an idle worker: the three are alike)
    assert picked(True, True) == "w0"  # not on full KV: the copy would evict cached blocks
    cold, hot_free, hot_full, cold_full = scores(False, False), scores(True, False), scores(True, True), scores(False, True)
    assert hot_free[copy] < cold[copy] and hot_free["w0"] == cold["w0"]
    # full KV: the copy costs what it costs a cold prefix (nothing else in flight: free KV or not)
    assert hot_full["w1"] == cold_full["w1"] == cold["w1"]


def test_a_prefix_spreads_to_a_second_and_a_third_worker_as_its_load_grows_and_folds_back_when_it_cools():
    """Background requests keep every worker at ~10 in flight; the prefix's requests then pile up (none
    finishes). It needs ceil(its requests / the mean per worker) workers: it stays on w0 while that is
    one, takes a second worker, then a third as it grows. Cooled (all finished) on full KV, its requests
    go back to one of its holders: the extra copies are left to the caches' eviction."""
    fleet = Fleet(learned_policy())
    for i in range(40):  # background: prompts of their own, spread by the score
        fleet.route(f"bg{i}")
    for w in WORKERS:  # the background's prefills are done: only their requests in flight remain
        fleet.queued[w] = 0
    first = fleet.route("hot")
    holders_by_size = []
    for _ in range(1, 80):
        fleet.route("hot")
        holders_by_size.append(sum("hot" in h for h in fleet.holds.values()))
    assert holders_by_size[:8] == [1] * 8, holders_by_size  # one worker while it is one worker's load
    assert max(holders_by_size) >= 3, holders_by_size
    # it grew one worker at a time, and only as its requests in flight grew
    assert all(b - a in (0, 1) for a, b in zip(holders_by_size, holders_by_size[1:], strict=False)), holders_by_size
    assert holders_by_size.index(2) < holders_by_size.index(3)
    holders = {w for w, h in fleet.holds.items() if "hot" in h}
    assert first in holders
    # it cools: every request finishes; the workers' KV is full (a copy displaces other prefixes)
    fleet.finish_all()
    fleet.full = set(WORKERS)
    picks = set()
    for _ in range(10):  # one at a time now: each finishes before the next
        picks.add(fleet.route("hot"))
        fleet.finish_all()
    assert len(picks) == 1 and picks <= holders, (picks, holders)


def test_a_cold_prefix_never_moves():
    """One request of the prefix at a time (each finishes before the next): it stays on its holder even
    while the holder has more queued than recomputing the prefix elsewhere would take."""
    p = learned_policy()
    q0 = query("cold", 0)
    for k in range(20):
        q = query("cold", k)
        queued = 6000 + 100 * k  # 0.24-0.32 s queued at the holder; recomputing elsewhere: 0.17 s
        cands = [cand("w0", PREFIX, queued=queued)] + [cand(w) for w in WORKERS[1:]]
        chosen = p.pick(q, cands)
        assert chosen.worker_id == "w0", k
        t = start(p, q, cands[0])
        p.finished(t, 64)
    assert q0.block_hashes[0] == q.block_hashes[0]


def test_a_new_prompt_goes_where_the_least_content_went_while_prompts_repeat():
    """Placement: a prompt no worker holds any of commits its worker to the requests that will share it;
    while prompts repeat, it goes, among the workers predicted no worse than the mean, to the one this
    router gave the fewest prompt tokens, not to the one idle now. Before prompts repeat (no-reuse),
    when the least given is busy now, and once every worker was given a full cache's worth, the score
    decides."""
    p = learned_policy()
    given = {"w0": 3, "w1": 1, "w2": 2, "w3": 4}  # prompts of 4,160 tokens each, routed earlier
    k = count()
    for w, n in given.items():
        for _ in range(n):
            q = query(f"fam{next(k)}", 0)
            p.finished(start(p, q, Candidate(w, f"{w}:1", 0, Load(num_total_blocks=TOTAL_BLOCKS))), 64)
    fresh = query("new", 0)
    # w0 idle, w1 (given the least) with a short queue, w2 and w3 long ones: the score alone picks w0
    cands = [cand("w0"), cand("w1", queued=500), cand("w2", queued=4000), cand("w3", queued=4000)]
    scores = dict(zip(WORKERS, p.scores(fresh, cands), strict=True))
    assert min(scores, key=scores.get) == "w0"
    assert p.prefixes.repeat_share == 0.0  # every prompt so far its own: nothing commits yet
    assert p.pick(fresh, cands).worker_id == "w0"
    # a family repeats: placements now commit workers to what follows
    q = query("fam0", 1)
    p.finished(start(p, q, cand("w0", PREFIX)), 64)
    assert p.prefixes.repeat_share > 0.0
    assert p.pick(fresh, cands).worker_id == "w1"
    # the least given with a long queue now (worse than the mean): not placed on, the score decides
    busy = [cand("w0"), cand("w1", queued=4000), cand("w2", queued=4000), cand("w3", queued=4000)]
    assert p.pick(fresh, busy).worker_id == "w0"
    # a prompt that continues something held is the score's (w2 holds it)
    held = [cand("w0"), cand("w1", queued=4000), cand("w2", PREFIX, queued=4000), cand("w3", queued=4000)]
    assert p.pick(query("fam2", 5), held).worker_id in ("w0", "w2")
    # every worker given more than its pool holds: full either way, the score decides
    small = [Candidate(c.worker_id, c.address, 0, Load(max_num_batched_tokens=8192, num_total_blocks=10,
                                                      num_free_blocks=10, queued_prefill_tokens=c.load.queued_prefill_tokens))
             for c in cands]
    assert p.pick(fresh, small).worker_id == "w0"


def test_a_prefix_with_more_holders_than_its_load_needs_folds_back_to_exactly_that_many():
    """Catches the fold-back off by one (issue 50: ``holders[need + 1:]``) and the fold-back removed: of the
    workers holding a prefix, those past the ``need`` it keeps busy (by rendezvous weight of its hash) are
    surplus, and only those."""
    from kvmesh.router.core.policies.base import rendezvous_weight
    from kvmesh.router.core.policies.prefix_load import PrefixLoad

    chain, workers = [block("fold", 0)], ["w0", "w1", "w2"]
    by_weight = sorted(range(3), key=lambda i: -rendezvous_weight(chain[0], workers[i]))
    load = PrefixLoad()
    # idle: the request being routed needs one holder; the other two hold the prefix's one block surplus
    assert [load.replicas(chain, workers, [1, 1, 1])[i] for i in by_weight] == [0.0, -1.0, -1.0]
    load.started(1, chain, "w0", 16)  # one more in flight (a worker carries at least one): two holders busy
    assert [load.replicas(chain, workers, [1, 1, 1])[i] for i in by_weight] == [0.0, 0.0, -1.0]


def test_free_kv_is_what_neither_cached_prefixes_nor_running_requests_nor_pending_picks_take():
    """Catches free KV ignoring used blocks (issue 50: ``taken = cached``) or pending blocks: of 100 blocks,
    60 in use (10 of them cached prefixes) and 5 of picks no report covers yet leave 35; cached blocks past
    those in use (all free blocks but 30 hold prefixes) leave 30 - 5."""
    from kvmesh.contract.index_protocol import Pending
    from kvmesh.router.core.policies.kv_aware import free_kv_blocks

    def worker(free: int, cached: int, pending: int) -> Candidate:
        return Candidate("w", "w:1", load=Load(num_total_blocks=100, num_free_blocks=free, num_cached_blocks=cached),
                         pending=Pending(blocks=pending))

    assert free_kv_blocks(worker(40, 10, 5)) == 35
    assert free_kv_blocks(worker(40, 70, 5)) == 25
    assert free_kv_blocks(worker(40, 10, 50)) == 0
    assert free_kv_blocks(Candidate("w", "w:1")) == 0  # no pool reported: unknown, not free


def test_several_routers_see_the_prompts_in_prefill_as_one_router_sees_its_own():
    """A worker reports its requests without a token yet, each prompt whole (``prefilling_tokens``): the
    other routers' picks weigh on a router's prediction as its own do (counted whole until their first
    token), not as the part still to compute. A router that counted only the part still to compute served
    0.86 of one router's rate on the synthetic trace behind 3 routers (2026-11-27); counting the other
    routers' whole, 0.94 (docs/router.md, "Several routers")."""
    p = learned_policy()
    q = query("solo", 0)
    own = Candidate("w0", "w0:1", 0, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                           num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=2000),
                    inflight_prefill_tokens=30_000)
    others = Candidate("w0", "w0:1", 0, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                              num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=2000,
                                              prefilling_tokens=30_000))
    assert p.scores(q, [own]) == p.scores(q, [others])
    # a pick another router reserved that the worker's report does not cover yet counts with its prompt, whole,
    # as it will once the report covers it
    reserved = Candidate("w0", "w0:1", 0, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                                num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=2000,
                                                prefilling_tokens=10_000), pending=Pending(0, 20_000, 0))
    covered = Candidate("w0", "w0:1", 0, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                               num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=22_000,
                                               prefilling_tokens=30_000))
    assert p.scores(q, [reserved]) == p.scores(q, [covered])
    # a long prompt mostly computed on w1 still weighs whole: w0's shorter queue wins
    w0 = Candidate("w0", "w0:1", 0, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                          num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=3000,
                                          prefilling_tokens=3000))
    w1 = Candidate("w1", "w1:1", 0, Load(max_num_batched_tokens=8192, num_total_blocks=TOTAL_BLOCKS,
                                          num_free_blocks=TOTAL_BLOCKS, queued_prefill_tokens=2000,
                                          prefilling_tokens=30_000))
    assert p.pick(q, [w0, w1]).worker_id == "w0"

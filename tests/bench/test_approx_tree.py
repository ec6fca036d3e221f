"""approx-tree (SGLang's cache-aware router): exact picks from the router-local tree, the launcher's
defaults, the balance override, trees that grow between sweeps and are cut leaves-first every 120 s."""

from __future__ import annotations

from kvmesh.contract.types import Load
from kvmesh.router.core.policies import POLICIES, make_policy
from kvmesh.router.core.policies.approx_tree import ApproxPrefixTree, ApproxTreeConfig, ApproxTreePolicy
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery


def _q(*hashes: bytes, prompt_len: int | None = None) -> RouteQuery:
    return RouteQuery(prompt_len if prompt_len is not None else 16 * len(hashes), 16, list(hashes))


def _cands(n: int = 3, inflight=(0, 0, 0), total_blocks: int = 0) -> list[Candidate]:
    return [Candidate(f"w{i}", f"a{i}", load=Load(num_total_blocks=total_blocks), inflight_requests=inflight[i])
            for i in range(n)]


def test_registered_with_sglang_launcher_defaults():
    assert isinstance(make_policy("approx-tree"), ApproxTreePolicy)
    assert "approx-tree" in POLICIES and not ApproxTreePolicy.uses_index
    c = ApproxTreeConfig()
    assert (c.cache_threshold, c.balance_abs_requests, c.balance_rel, c.eviction_interval_s, c.max_tree_chars) == \
        (0.3, 64, 1.5, 120.0, 2 ** 26)
    assert c.max_tree_blocks(64) == 2 ** 26 // (4 * 64)


def test_follows_its_own_tree_then_spreads_new_prefixes():
    p = ApproxTreePolicy(PolicyConfig(seed=0))
    c = _cands()
    first = p.pick(_q(b"a", b"b", b"c"), c)
    assert first.reason == "capacity"
    # same prefix, 2 of 3 blocks matched (67 % > 30 %) -> the same worker
    again = p.pick(_q(b"a", b"b", b"x"), c)
    assert (again.worker_id, again.reason, again.score) == (first.worker_id, "tree", 32)
    # a new prefix goes to an empty tree (smallest), never to the one holding 4 blocks
    other = p.pick(_q(b"z", b"y"), c)
    assert other.reason == "capacity" and other.worker_id != first.worker_id
    # 1 of 4 blocks matched = 25 % <= threshold -> smallest tree: the third worker
    third = p.pick(_q(b"a", b"q", b"r", b"s"), c)
    assert third.reason == "capacity" and third.worker_id not in (first.worker_id, other.worker_id)


def test_cache_threshold_is_strictly_more_than_30_percent():
    p = ApproxTreePolicy(PolicyConfig(seed=0))
    blocks = [bytes([i]) for i in range(10)]
    p.tree.insert("w0", blocks[:4])
    p.tree.insert("w1", [b"other"] * 1)
    c = _cands(n=2)
    assert p.pick(_q(*blocks[:3], *[b"n%d" % i for i in range(7)]), c).reason == "capacity"  # 3/10 = 30 %
    d = p.pick(_q(*blocks[:4], *[b"m%d" % i for i in range(6)]), c)  # 4/10 = 40 %
    assert (d.worker_id, d.reason) == ("w0", "tree")


def test_balance_overrides_tree_and_takes_the_first_least_busy():
    p = ApproxTreePolicy(PolicyConfig(seed=0), ApproxTreeConfig(balance_abs_requests=4, balance_rel=1.5))
    p.tree.insert("w0", [b"a", b"b"])
    assert p.pick(_q(b"a", b"b"), _cands(inflight=(4, 1, 2))).worker_id == "w0"  # 4 - 1 = 3: not imbalanced
    d = p.pick(_q(b"a", b"b"), _cands(inflight=(9, 2, 2)))
    assert (d.worker_id, d.reason) == ("w1", "balance")
    assert p.tree.match("w1", [b"a", b"b"]) == 2  # inserted where it went


def test_default_balance_needs_more_than_64_requests_and_1_5_times():
    p = ApproxTreePolicy(PolicyConfig(seed=0))
    p.tree.insert("w0", [b"a", b"b"])
    assert p.pick(_q(b"a", b"b"), _cands(inflight=(69, 5, 6))).reason == "tree"  # 69 - 5 = 64: not more
    assert p.pick(_q(b"a", b"b"), _cands(inflight=(70, 5, 6))).reason == "balance"
    assert p.pick(_q(b"a", b"b"), _cands(inflight=(170, 120, 121))).reason == "tree"  # 170 < 1.5 x 120


def test_trees_grow_between_sweeps_and_are_cut_every_120s_leaves_first():
    now = [0.0]
    cfg = ApproxTreeConfig(max_tree_chars=4 * 16 * 3)  # 3 blocks of 16 tokens
    p = ApproxTreePolicy(PolicyConfig(seed=0, clock=lambda: now[0]), cfg)
    c = _cands(n=1, total_blocks=2)  # the worker's own capacity no longer bounds the tree
    p.pick(_q(b"a", b"b", b"c"), c)
    now[0] = 10.0
    p.pick(_q(b"a", b"d"), c)
    assert p.tree.size("w0") == 4
    now[0] = 119.0
    p.pick(_q(b"a", b"d"), c)
    assert p.tree.size("w0") == 4  # no sweep yet
    now[0] = 121.0
    p.pick(_q(b"a", b"b"), c)  # the sweep runs first: c, the least recent leaf, goes
    assert p.tree.size("w0") == 3
    assert p.tree.match("w0", [b"a", b"b", b"c"]) == 2 and p.tree.match("w0", [b"a", b"d"]) == 2


def test_tree_eviction_drops_a_chains_tail_before_its_head():
    t = ApproxPrefixTree()
    t.insert("w", [b"a", b"b", b"c"])
    t.insert("w", [b"x"])
    t.evict(3)
    assert t.match("w", [b"a", b"b", b"c"]) == 2 and t.match("w", [b"x"]) == 1
    t.forget({"other"})
    assert t.size("w") == 0

"""approx-tree: exact picks from the router-local tree, capacity eviction, balance override."""

from __future__ import annotations

from kvmesh.contract.types import Load
from kvmesh.router.policies import POLICIES, make_policy
from kvmesh.router.policies.approx_tree import ApproxPrefixTree, ApproxTreeConfig, ApproxTreePolicy
from kvmesh.router.policies.base import Candidate, PolicyConfig, RouteQuery


def _q(*hashes: bytes, prompt_len: int | None = None) -> RouteQuery:
    return RouteQuery(prompt_len if prompt_len is not None else 16 * len(hashes), 16, list(hashes))


def _cands(n: int = 3, inflight=(0, 0, 0), total_blocks: int = 0) -> list[Candidate]:
    return [Candidate(f"w{i}", f"a{i}", load=Load(num_total_blocks=total_blocks), inflight_requests=inflight[i])
            for i in range(n)]


def test_registered():
    assert isinstance(make_policy("approx-tree"), ApproxTreePolicy)
    assert "approx-tree" in POLICIES and not ApproxTreePolicy.uses_index


def test_follows_its_own_tree_then_spreads_new_prefixes():
    p = ApproxTreePolicy(PolicyConfig(seed=0))
    c = _cands()
    first = p.pick(_q(b"a", b"b", b"c"), c)
    assert first.reason == "capacity"
    # same prefix, > 50 % matched -> the same worker
    again = p.pick(_q(b"a", b"b", b"x"), c)
    assert (again.worker_id, again.reason, again.score) == (first.worker_id, "tree", 32)
    # a new prefix goes to an empty tree (smallest), never to the one holding 4 blocks
    other = p.pick(_q(b"z", b"y"), c)
    assert other.reason == "capacity" and other.worker_id != first.worker_id
    # 1 of 4 blocks matched = 25 % <= threshold -> smallest tree: the third worker
    third = p.pick(_q(b"a", b"q", b"r", b"s"), c)
    assert third.reason == "capacity" and third.worker_id not in (first.worker_id, other.worker_id)


def test_balance_overrides_tree():
    p = ApproxTreePolicy(PolicyConfig(seed=0), ApproxTreeConfig(balance_abs_requests=4, balance_rel=1.5))
    p.tree.insert("w0", [b"a", b"b"], 100)
    assert p.pick(_q(b"a", b"b"), _cands(inflight=(4, 1, 2))).worker_id == "w0"  # 4 - 1 = 3: not imbalanced
    d = p.pick(_q(b"a", b"b"), _cands(inflight=(9, 3, 2)))
    assert (d.worker_id, d.reason) == ("w2", "balance")
    assert p.tree.match("w2", [b"a", b"b"]) == 2  # inserted where it went


def test_tree_lru_capacity_drops_tail_first():
    t = ApproxPrefixTree()
    t.insert("w", [b"a", b"b", b"c"], capacity=3)
    t.insert("w", [b"a", b"d"], capacity=3)  # b is now least recent
    assert t.match("w", [b"a", b"d"]) == 2 and t.match("w", [b"a", b"b"]) == 1 and t.size("w") == 3
    assert t.match("w", [b"x"]) == 0 and t.match("none", [b"a"]) == 0
    t.forget({"other"})
    assert t.size("w") == 0


def test_capacity_from_reported_load():
    p = ApproxTreePolicy(PolicyConfig(seed=0))
    c = _cands(n=1, total_blocks=2)
    p.pick(_q(b"a", b"b", b"c"), c)
    assert p.tree.size("w0") == 2

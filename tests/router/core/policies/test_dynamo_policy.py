"""dynamo: the cost on the router's own active sequences (unique blocks, new blocks, pending prefill),
their lifecycle and expiry, and replica sync between two routers' policies."""

from __future__ import annotations

import hashlib

from kvmesh.contract.types import Load
from kvmesh.router.core.inflight import InFlight, Ticket
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.dynamo import EXPIRY_S, ActiveSequenceEvent, ActiveSequences, DynamoPolicy

BS = 16
PREFIX = [hashlib.sha256(b"prefix%d" % i).digest()[:16] for i in range(64)]


def request(tag: str, prefix_blocks: int = 64, own_blocks: int = 4) -> RouteQuery:
    own = [hashlib.sha256(f"{tag}{i}".encode()).digest()[:16] for i in range(own_blocks)]
    return RouteQuery((prefix_blocks + own_blocks) * BS, BS, PREFIX[:prefix_blocks] + own)


def fleet(holder_load: Load | None = None) -> list[Candidate]:
    """8 workers; w0 holds the 64-block prefix in the index (and reports whatever load is given)."""
    return [Candidate("w0", "a0", load=holder_load or Load(), indexed_blocks=64)] + \
        [Candidate(f"w{i}", f"a{i}") for i in range(1, 8)]


def send(p: DynamoPolicy, inflight: InFlight, q: RouteQuery, c: Candidate, prefilled: bool = True) -> Ticket:
    ticket = inflight.start(c.worker_id, 0)
    p.started(ticket, q, c)
    if prefilled:
        p.prefilled(ticket)
    return ticket


def test_a_shared_prefix_is_charged_once_so_the_holder_keeps_16_requests():
    # Each request: the 64-block prefix w0 holds + 4 blocks of its own (1088 tokens), all decoding.
    #   w0 with k requests active: prefill (1088 - 64*16)/16 = 4, decode 64 + 4k unique + 4 new -> 72 + 4k
    #   an idle worker: prefill 1088/16 = 68, decode 0 + 68 new                                -> 136
    # so w0 keeps requests 0..15 (72 .. 132). Charging every request's whole prompt (the old
    # count, 68 blocks each) would have left w0 at the third request (8 + 68k > 136 for k >= 2).
    # w0's reported load is huge: Dynamo never reads it.
    p = DynamoPolicy(PolicyConfig(seed=0))
    inflight = InFlight()
    cands = fleet(Load(num_running=200, num_waiting=50, queued_prefill_tokens=10**6, num_total_blocks=100))
    tickets = []
    for k in range(16):
        q = request(f"r{k}")
        d = p.pick(q, cands)
        assert (d.worker_id, d.reason, d.score) == ("w0", "prefix", 72 + 4 * k)
        tickets.append(send(p, inflight, q, cands[0]))
    assert p.sequences.view("w0", request("x").block_hashes) == (64 + 4 * 16, 0, 4)
    send(p, inflight, request("r16"), cands[0])  # a 17th on w0: 72 + 4*17 = 140 > 136
    d = p.pick(request("r17"), cands)
    assert d.worker_id != "w0" and (d.reason, d.score) == ("load", 136)
    # the requests end: w0 is back to its empty cost, and keeps nothing of them
    for t in tickets:
        p.finished(t, 10)
    assert p.pick(request("r18"), cands).score == 72 + 4 * 1


def test_pending_prefill_counts_until_the_first_token_and_free_drops_the_worker():
    p = DynamoPolicy(PolicyConfig(seed=0))
    inflight = InFlight()
    w1 = Candidate("w1", "a1")  # holds nothing: all 1088 tokens are to compute
    t = send(p, inflight, request("a"), w1, prefilled=False)
    q = request("b")
    assert p.sequences.view("w1", q.block_hashes) == (68, 1088, 4)
    # w1: prefill (1088 + 1088)/16 = 136, decode 68 + 4 new = 72 -> 208; w2 idle: 136
    d = p.pick(q, [w1, Candidate("w2", "a2")])
    assert (d.worker_id, d.score) == ("w2", 136)
    p.prefilled(t)
    assert p.sequences.view("w1", q.block_hashes) == (68, 0, 4)
    p.finished(t, 5)
    assert p.sequences.view("w1", q.block_hashes) == (0, 0, 68) and len(p.sequences) == 0
    assert p.sequences._workers == {}  # NOTE: nothing kept for an idle worker: the state is bounded


def test_a_prompt_shorter_than_a_block_outlives_its_workers_entry():
    # A request with no full block, prefilled, weighs nothing on its worker; when the worker's last
    # weighing request is freed its entry goes, and freeing the short one then is a no-op (it was a
    # KeyError: the simulator's dynamo on the synthetic trace, 64-token blocks).
    seqs = ActiveSequences()
    seqs.add(("r", 1), "w1", [], 10, now=0.0)
    seqs.add(("r", 2), "w1", [b"h1", b"h2"], 128, now=0.0)
    seqs.prefilled(("r", 1))
    seqs.prefilled(("r", 2))
    seqs.free(("r", 2))
    assert seqs._workers == {} and len(seqs) == 1
    seqs.prefilled(("r", 1))
    seqs.free(("r", 1))
    assert len(seqs) == 0 and seqs.view("w1", [b"h1"]) == (0, 0, 1)

def test_overlap_is_the_index_answer_not_the_speculative_match():
    p = make_policy("dynamo", PolicyConfig(seed=0))
    q = request("a")
    # a: speculative match only (matched_blocks 64, indexed 0); b: idle. Both cost 136: a tie.
    picks = {p.pick(q, [Candidate("a", "x", matched_blocks=64), Candidate("b", "y")]).score for _ in range(4)}
    assert picks == {136}


def test_requests_never_freed_expire_after_a_full_sweep_period():
    s = ActiveSequences()
    s.add(("r", 1), "w0", PREFIX[:2], 32, now=0.0)  # the first sweep is due at 300 s
    s.add(("r", 2), "w0", PREFIX[:2], 32, now=10.0)
    s.free(("r", 2))
    # sweep 1 (before r3 is added): frees nothing, remembers what is active: r1
    s.add(("r", 3), "w0", PREFIX[:3], 0, now=EXPIRY_S + 1)
    assert len(s) == 2 and s.view("w0", PREFIX[:3]) == (3, 32, 0)
    s.add(("r", 4), "w1", PREFIX[:1], 0, now=EXPIRY_S + 2)
    s.add(("r", 5), "w1", PREFIX[:1], 0, now=2 * EXPIRY_S + 2)  # sweep 2: r1, active since sweep 1, goes
    assert len(s) == 3 and s.view("w0", PREFIX[:3]) == (3, 0, 0)


def test_replica_sync_applies_a_peers_add_prefill_and_free_and_skips_its_own():
    a, b = DynamoPolicy(PolicyConfig(seed=0)), DynamoPolicy(PolicyConfig(seed=1))
    sent: list[object] = []
    a.sync_replicas("router-0", sent.append)
    b.sync_replicas("router-1", lambda e: None)
    ticket = send(a, InFlight(), request("a"), Candidate("w1", "a1"), prefilled=False)
    assert [e.kind for e in sent if isinstance(e, ActiveSequenceEvent)] == ["add"]
    q = request("b")
    assert b.sequences.view("w1", q.block_hashes) == (0, 0, 68)  # nothing until the batch arrives
    b.apply_replica_events(sent)
    a.apply_replica_events(sent)  # its own events: already applied, skipped
    assert b.sequences.view("w1", q.block_hashes) == a.sequences.view("w1", q.block_hashes) == (68, 1088, 4)
    # router B now avoids the worker router A loaded: w1 208 (see above) against w2's 136
    assert b.pick(q, [Candidate("w1", "a1"), Candidate("w2", "a2")]).worker_id == "w2"
    a.prefilled(ticket)
    a.finished(ticket, 3)
    b.apply_replica_events(sent[1:])
    assert [e.kind for e in sent] == ["add", "prefilled", "free"]
    assert b.sequences.view("w1", q.block_hashes) == (0, 0, 68) and len(b.sequences) == 0

"""The conversions of kvmesh/contract/convert.py, the hand-made Lookup reply encoder against protobuf's own."""

from __future__ import annotations

import pytest

from kvmesh.contract.convert import LookupReplies, load_to_pb, match_from_pb, match_to_pb, varint
from kvmesh.contract.index_protocol import NO_PENDING, Pending, WorkerMatch
from kvmesh.contract.types import Load
from kvmesh.v1 import kv_service_pb2 as pb


def test_lookup_replies_from_cached_wire_bytes_equal_the_field_by_field_message():
    replies = LookupReplies()
    # Rounds 0 and 1: new loads (rebuilt); 2: equal loads in new objects; 3: the same objects;
    # 4: a worker moved to another address.
    loads: list[Load] = []
    for round_ in range(5):
        if round_ != 3:
            loads = [Load(i, min(round_, 1), 90, 2**20, 2**40 + i) for i in range(40)]
        # NOTE: a host continuation on every third worker, past 127 on some (a two-byte varint)
        matches = [WorkerMatch(f"w{i}", f"10.0.0.{i + (round_ == 4)}:50061", (i * 37 + round_) % 300, loads[i], 16,
                               pending_blocks=(i % 3) * 64 * round_,
                               host_blocks=(i * 61 + round_) % 400 if i % 3 == 0 else 0)
                   for i in range(40)]
        want = pb.LookupResponse(
            workers=[pb.WorkerMatch(worker_id=m.worker_id, address=m.address, matched_blocks=m.matched_blocks,
                                    load=load_to_pb(m.load), block_size=m.block_size, pending_blocks=m.pending_blocks,
                                    host_blocks=m.host_blocks)
                     for m in matches],
            block_size=16, num_blocks_queried=300 + round_)
        assert replies.response(matches, 16, 300 + round_) == want
    assert replies.response([], 0, 0) == pb.LookupResponse()


@pytest.mark.parametrize("n", [1, 127, 128, 300, 2**14 - 1, 2**14, 2**21, 2**35, 2**63])
def test_varint_is_protobufs_encoding(n):
    assert varint(n) == pb.PendingPicks(version=n).SerializeToString()[1:]


def test_each_cached_entry_reads_as_protobufs_own_encoding_of_the_match():
    """Every field of a WorkerMatch (pending picks with zeros left out, multi-byte varints) through the
    cached-bytes encoder: the bytes parse to the message match_to_pb builds, which protobuf serializes
    to the same bytes as the reply re-serialized, and back to the same record."""
    replies = LookupReplies()
    pendings = [NO_PENDING, Pending(version=1), Pending(3, 0, 24, 7), Pending(1, 2**20, 2**15, 2**33)]
    matches = [WorkerMatch(f"w{i}", f"10.0.0.{i}:50061", (i * 131) % 70_000, Load(i, 1, 90, 2**20, 2**40 + i), 16,
                           pendings[i % len(pendings)], pending_blocks=(i % 5) * 40, host_blocks=(i * 7) % 3 * 200)
               for i in range(24)]
    for m in matches:
        want = match_to_pb(m)
        got = pb.WorkerMatch.FromString(replies._entry(m))
        assert got == want and got.SerializeToString() == want.SerializeToString()
        assert match_from_pb(got) == m
    reply = replies.response(matches, 16, 70_000)
    expected = pb.LookupResponse(workers=[match_to_pb(m) for m in matches], block_size=16, num_blocks_queried=70_000)
    assert reply.SerializeToString() == expected.SerializeToString()

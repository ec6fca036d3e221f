"""The engine's event stream over real ZMQ sockets: order, gaps replayed, what replay no longer
holds reported lost, a restarted engine detected, the slow joiner recovered, bad frames dropped."""

from __future__ import annotations

import time

import pytest
import zmq

from kvmesh.bridge.event_stream import Batch, EngineEventStream, Lost, Restarted
from tests.support.engine_double import EngineDouble


@pytest.fixture
def engine():
    e = EngineDouble()
    yield e
    e.close()


def connected(engine: EngineDouble, replay: bool = True) -> EngineEventStream:
    s = EngineEventStream(engine.events, engine.replay if replay else None, replay_timeout_s=1.0)
    s.connect()
    # NOTE: a SUB socket misses what is published before its subscription reaches the PUB; a probe
    # batch that arrives proves it did (and the stream is told it is the start).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        engine.publish([])
        if s.poll(0.05):
            break
    engine.new_process()
    s.reset()
    return s


def until_live(engine: EngineDouble, s: EngineEventStream) -> list:
    """Publishes until a batch arrives live (the subscription may still be on its way)."""
    out: list = []
    deadline = time.monotonic() + 5
    while not [i for i in out if isinstance(i, Batch) and not i.replayed] and time.monotonic() < deadline:
        engine.publish([])
        out += s.poll(0.05)
    return out


def drain(s: EngineEventStream, want: int, timeout: float = 5.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len([i for i in out if isinstance(i, Batch)]) < want and time.monotonic() < deadline:
        out += s.poll(0.05)
    return out


def seqs(items) -> list[int]:
    return [i.seq for i in items if isinstance(i, Batch)]


def test_in_order_then_a_gap_is_filled_by_replay(engine):
    s = connected(engine)
    for _ in range(3):
        engine.store([1], None, list(range(32)))
    assert seqs(drain(s, 3)) == [0, 1, 2]
    engine.drop = 2  # the PUB socket loses 3 and 4
    before = s.replays
    for _ in range(3):
        engine.remove([1])
    items = drain(s, 3)
    assert seqs(items) == [3, 4, 5] and [i.replayed for i in items] == [True, True, False]
    assert s.replays == before + 1 and not any(isinstance(i, Lost) for i in items)
    s.close()


def test_what_the_replay_buffer_no_longer_holds_is_lost(engine):
    engine.buffer = type(engine.buffer)(maxlen=2)
    s = connected(engine)
    engine.publish([])
    assert seqs(drain(s, 1)) == [0]
    engine.drop = 4  # 1..4 lost live; the buffer keeps only 3 and 4 once 5 is out
    for _ in range(5):
        engine.publish([])
    items = drain(s, 3)
    assert [type(i).__name__ for i in items] == ["Lost", "Batch", "Batch"]
    assert (items[0].first, items[0].end) == (1, 4) and seqs(items) == [4, 5]
    s.close()


def test_no_replay_endpoint_reports_every_gap_lost(engine):
    s = connected(engine, replay=False)
    engine.publish([])
    drain(s, 1)
    engine.drop = 1
    engine.publish([])
    engine.publish([])
    items = drain(s, 1)
    assert isinstance(items[0], Lost) and (items[0].first, items[0].end) == (1, 2) and seqs(items) == [2]
    s.close()


def test_a_seq_going_back_is_a_new_engine_process(engine):
    s = connected(engine)
    for _ in range(3):
        engine.publish([])
    drain(s, 3)
    engine.new_process()
    engine.publish([])
    items = drain(s, 1)
    assert isinstance(items[0], Restarted) and seqs(items) == [0]
    s.close()


def test_attach_replays_what_was_published_before_the_bridge_came(engine):
    # the slow joiner: batches sent while no subscriber listened are recovered from seq 0
    for i in range(4):
        engine.store([i + 1], i or None, list(range(32 * i, 32 * (i + 1))))
    s = EngineEventStream(engine.events, engine.replay, replay_timeout_s=1.0)
    s.connect()
    items = s.attach()
    assert seqs(items) == [0, 1, 2, 3] and all(i.replayed for i in items) and s.expected == 4
    got = seqs(until_live(engine, s))
    assert got == list(range(4, 4 + len(got)))  # whatever the subscription missed came by replay
    s.close()


def test_sglang_replay_frames_and_malformed_frames(engine):
    engine.sglang_replay = True  # [b"", seq, payload]: no topic frame
    for _ in range(2):
        engine.publish([])
    s = EngineEventStream(engine.events, engine.replay, replay_timeout_s=1.0)
    s.connect()
    assert seqs(s.attach()) == [0, 1]
    # a frame that is not (topic, 8-byte seq, payload) is counted and dropped
    got = until_live(engine, s)
    assert seqs(got) == list(range(2, 2 + len(seqs(got))))
    engine.pub.send_multipart([b"", b"short", b"x"])
    engine.pub.send_multipart([b"only one frame"])
    last = engine.publish([])
    assert seqs(drain(s, 1)) == [last] and s.bad_frames == 2
    s.close()


def test_a_replay_that_never_answers_counts_as_failed():
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    from kvmesh.loopback import free_port

    port = free_port()
    silent.bind(f"tcp://127.0.0.1:{port}")
    s = EngineEventStream("tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}", replay_timeout_s=0.2)
    s.connect()
    assert s.attach() == [] and s.replay_failures == 1
    items = s._live(5, b"")
    assert isinstance(items[0], Lost) and items[0].reason == "replay failed" and seqs(items) == [5]
    s.close()
    silent.close(0)

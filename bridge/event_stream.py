"""An engine's KV event batches, in sequence order, from its ZMQ publisher.

vLLM and SGLang publish ``(topic, seq, payload)`` on a PUB socket (``seq``: 8 bytes big-endian,
from 0 in each engine process) and keep the last ``buffer_steps`` batches for replay on a ROUTER
socket: a DEALER sends ``[b"", start_seq]`` and gets every buffered batch from there, then an end
marker (seq -1). PUB drops silently when a subscriber lags, and a subscriber misses whatever was
sent before it connected (the "slow joiner"), so:

- on attach, and whenever the next batch's seq is past the one expected, the missing batches are
  replayed; what the engine no longer buffers (or a replay that does not answer) is reported as
  :class:`Lost`;
- a seq below the one expected (and not a replayed one seen again live) means a new engine process:
  :class:`Restarted`;
- a lost batch shows as a gap only when the next one arrives: while no batch comes for
  ``idle_replay_s``, the stream asks the replay for anything past the last one it has (an idle
  engine's last batch is not left out until its next).

One thread owns the sockets (pyzmq sockets are not thread-safe); it calls :meth:`poll`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import zmq

log = logging.getLogger("kvmesh.bridge.events")

END_SEQ = -1
MAX_FRAME_BYTES = 32 << 20
"""Messages larger than this are dropped by the socket itself (ZMQ_MAXMSGSIZE)."""


@dataclass(slots=True, frozen=True)
class Batch:
    seq: int
    payload: bytes
    replayed: bool = False


@dataclass(slots=True, frozen=True)
class Lost:
    """Batches ``first`` .. ``end - 1`` are gone (``end`` None: unknown, from ``first`` on)."""

    first: int
    end: int | None
    reason: str


@dataclass(slots=True, frozen=True)
class Restarted:
    """A batch with ``seq`` below the expected one: the engine process is new."""

    seq: int


Item = Batch | Lost | Restarted


def _seq(raw: bytes) -> int | None:
    return int.from_bytes(raw, "big", signed=True) if len(raw) == 8 else None


class EngineEventStream:
    """Args:
    endpoint: the engine's PUB endpoint (``tcp://host:5557``).
    replay_endpoint: its ROUTER endpoint (``tcp://host:5558``); None = no replay (every gap is lost).
    topic: the engine's topic (vLLM's default "").
    replay_timeout_s: a replay that has not ended after this long counts as failed.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 replay_timeout_s: float = 2.0, idle_replay_s: float = 1.0, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.idle_replay_s = idle_replay_s
        self._last_news = time.monotonic()
        self._ctx = context or zmq.Context.instance()
        self._sub: zmq.Socket | None = None
        self.expected: int | None = None
        """The next seq wanted; None = from the engine's first batch (attach / restart)."""
        self._dup_floor: int | None = None
        self.replays = 0
        """Replays asked for a gap (or at attach)."""
        self.idle_replays = 0
        """Replays asked while no batch came (``idle_replay_s``)."""
        self.replay_failures = 0
        self.bad_frames = 0
        self.received = 0

    # -- sockets ------------------------------------------------------------------------------
    def connect(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.endpoint)
        self._sub = sub
        # NOTE: what the engine publishes before our subscription reaches it is lost (the slow
        # joiner): wait (briefly) for the connection, so the attach replay covers up to a point the
        # live stream continues from.
        try:
            monitor.poll(2000)
        finally:
            sub.disable_monitor()
            monitor.close(0)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    # -- the stream ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the position (the engine restarted): the next poll starts from its first batch."""
        self.expected = None
        self._dup_floor = None

    def attach(self) -> list[Item]:
        """Everything the engine still buffers, from seq 0 (a replay); call after :meth:`connect`
        and after :meth:`reset`. Without a replay endpoint, nothing (the first live batch decides)."""
        if self.replay_endpoint is None:
            return []
        return self._replay_from(0, None)

    def poll(self, timeout_s: float) -> list[Item]:
        """Live batches that arrived within ``timeout_s`` (at least one wait), in order, with
        replays filling any gap before them."""
        assert self._sub is not None, "connect() first"
        out: list[Item] = []
        if not self._sub.poll(int(timeout_s * 1000)):
            now = time.monotonic()
            if self.replay_endpoint is not None and self.idle_replay_s and now - self._last_news > self.idle_replay_s:
                self._last_news = now
                self.idle_replays += 1
                out += self._replay_from(self.expected or 0, None, idle=True)
            return out
        self._last_news = time.monotonic()
        for _ in range(10_000):  # NOTE: bounded, so the caller's loop gets back control
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.received += 1
            if len(frames) != 3 or (seq := _seq(frames[1])) is None or seq < 0:
                self.bad_frames += 1
                continue
            out += self._live(seq, frames[2])
        return out

    def _live(self, seq: int, payload: bytes) -> list[Item]:
        out: list[Item] = []
        expected = self.expected
        if expected is not None and seq < expected:
            if self._dup_floor is not None and seq >= self._dup_floor:
                return out  # seen already, through a replay
            out.append(Restarted(seq))
            self.reset()
            expected = None
        if expected is None:
            expected = 0
        if seq > expected:
            out += self._replay_from(expected, seq)
        out.append(Batch(seq, payload))
        self.expected = seq + 1
        self._dup_floor = None
        return out

    def _replay_from(self, start: int, until: int | None, idle: bool = False) -> list[Item]:
        """Batches ``start`` .. ``until`` - 1 (None: all buffered) from the engine, and what it lacks."""
        got, ok = self._request_replay(start)
        self.replays += 0 if idle else 1
        if not ok:
            self.replay_failures += 1
            if until is None:
                return []  # attach: nothing known yet; the first live batch decides
            self.expected = until
            return [Lost(start, until, "replay failed" if self.replay_endpoint else "no replay endpoint")]
        wanted = [(s, p) for s, p in got if s >= start and (until is None or s < until)]
        out: list[Item] = []
        first = wanted[0][0] if wanted else until
        if first is not None and first > start:
            out.append(Lost(start, first, "no longer in the engine's replay buffer"))
        out += [Batch(s, p, replayed=True) for s, p in wanted]
        if wanted:
            self.expected = wanted[-1][0] + 1
            # NOTE: the same batches may still sit in the SUB queue: seen live, they are not news.
            self._dup_floor = start
        elif until is not None:
            self.expected = until
        return out

    def _request_replay(self, start: int) -> tuple[list[tuple[int, bytes]], bool]:
        """(batches, whether the replay ended with its end marker)."""
        if self.replay_endpoint is None:
            return [], False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.setsockopt(zmq.RCVHWM, 0)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    log.warning("replay from seq %d at %s did not end within %.1fs", start, self.replay_endpoint,
                                self.replay_timeout_s)
                    return got, False
                frames = sock.recv_multipart()
                # [b"", topic, seq, payload] (vLLM) or [b"", seq, payload] (SGLang before 0.5)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:
                    frames = frames[1:]
                if len(frames) != 2 or (seq := _seq(frames[0])) is None:
                    self.bad_frames += 1
                    continue
                if seq == END_SEQ:
                    got.sort(key=lambda sp: sp[0])
                    return got, True
                got.append((seq, frames[1]))
        finally:
            sock.close(linger=0)

"""Runs an LLMEngine on its own thread and fans its outputs out to per-request streams.

The gRPC server (model_worker/serving/server.py, on an event loop) calls ``submit_async`` / ``abort``
and awaits the returned stream; the step thread hands each step's tokens for every stream of a
loop to it in ONE ``loop.call_soon_threadsafe`` (no polling, one wake-up of the loop per step,
not per stream). ``submit`` gives a blocking iterator instead, for callers on plain threads. The
step loop never waits on gRPC and gRPC never waits on a step beyond that hand-off. Tokens reach their streams after every inner step of a multi-step
window (``LLMEngine.step``'s ``on_output``), not when the window ends. After every step the block events go to a sink (the kv_service
publisher); a snapshot of the cached blocks is taken on this thread when the sink asks for one,
so events and snapshots keep their order. No grpc import here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from kvmesh.contract.errors import AlreadyExists
from kvmesh.contract.limits import excerpt
from kvmesh.contract.types import KVCacheEvent, SamplingParams
from kvmesh.model_worker.engine.kv_legs import KVLeg
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.engine.timeline import RequestTimeline
from kvmesh.model_worker.scheduling.output import RequestOutput

log = logging.getLogger("kvmesh.worker.engine")

T = TypeVar("T")


@dataclass(slots=True)
class TokenEvent:
    """One message of a request's stream: a token, or the end with its reason and usage."""

    token_id: int | None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


class AsyncTokenStream:
    """A request's events on an event loop: ``await next_batch()`` returns every event ready
    (at least one); the last batch ends with the terminal event (``token_id is None``)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[TokenEvent] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, batch: list[TokenEvent]) -> None:
        """On the loop's thread (the step thread posts it with call_soon_threadsafe)."""
        self._items.extend(batch)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self) -> list[TokenEvent]:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


def _push_all(items: list[tuple[AsyncTokenStream, list[TokenEvent]]]) -> None:
    for reader, batch in items:
        reader.push(batch)


@dataclass(slots=True)
class Stream:
    queue: queue.Queue[list[TokenEvent]] | None = None
    """The blocking reader's queue (``submit``); None for a reader on a loop."""
    loop: asyncio.AbstractEventLoop | None = None
    reader: AsyncTokenStream | None = None
    pending: list[TokenEvent] = field(default_factory=list)
    """Tokens held back by ``stream_interval`` (step thread only)."""
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = -1
    """Prompt tokens the prefix cache served at admission; -1 until an output said (step thread)."""
    timeline: RequestTimeline | None = None
    """A traced request's steps (engine/timeline.py); None = not traced (the step thread skips it)."""


class EventSink:
    """Where block events go (the kv_service publisher implements it)."""

    def publish(self, events: list[KVCacheEvent]) -> None: ...

    def wants_snapshot(self) -> bool:
        return False

    def publish_snapshot(self, hashes: list[bytes], host_hashes: list[bytes] | None = None) -> None: ...


class EngineLoop:
    """Owns the engine's step thread.

    Args:
        engine: the engine; only this loop calls its ``step``.
        sink: receives block events after every step and snapshots on request.
        on_step: called after each step with the step's outputs and wall time (metrics).
        stream_interval: hand a stream its tokens in groups of this many (vLLM's
            ``--stream-interval``): the first token and the last ones go out at once, the others
            when ``stream_interval`` have piled up. 1 = every token as soon as it is sampled.
            Larger values cut the per-message host cost (thread wake-ups, gRPC writes) of long
            outputs; TTFT does not change.
    """

    def __init__(self, engine: LLMEngine, sink: EventSink | None = None,
                 on_step: Callable[[list[RequestOutput], float], None] | None = None,
                 on_finish: Callable[[Stream, TokenEvent], None] | None = None,
                 on_token: Callable[[Stream, float], None] | None = None, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.stream_interval = stream_interval
        self.sink = sink or EventSink()
        self._on_step = on_step
        self._on_finish = on_finish
        self._on_token = on_token
        self._streams: dict[str, Stream] = {}
        self._traced: dict[str, RequestTimeline] = {}
        self._step_ns = 0
        """The streams that carry a timeline (tracing on and a trace came with the request)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def thread(self) -> threading.Thread:
        """The step thread: the one thread that touches the engine's scheduler, pool and P/D holds."""
        return self._thread

    def wake(self) -> None:
        """Makes an idle loop run once (e.g. to answer a snapshot request)."""
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Runs ``fn(engine)`` on the step thread before its next step (LLMEngine.call_on_step_thread), an idle
        loop woken for it; the future has its result. How the transfer side asks the engine's side of P/D."""
        future = self.engine.call_on_step_thread(fn)
        self._wake.set()
        return future

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str = "", lora_name: str | None = None) -> Iterator[list[TokenEvent]]:
        """Queues a request; returns its event stream. Raises ValueError on bad input.

        Each item is every event that was ready when the consumer asked (at least one), in order;
        the last item ends with the terminal event. A consumer that keeps up gets one token per
        item; one that falls behind (a busy host, a multi-step window) gets them coalesced, so it
        sends one message where it would have sent several. ``lora_name``: the LoRA adapter to run it under.
        """
        stream = Stream(queue=queue.Queue())
        self._add(request_id, stream, prompt_token_ids, params, cache_salt, lora_name=lora_name)
        return self._iterate(request_id, stream)

    def submit_async(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     cache_salt: str = "", timeline: RequestTimeline | None = None,
                     leg: KVLeg | None = None, lora_name: str | None = None) -> AsyncTokenStream:
        """As ``submit``, for a caller on an event loop (this one receives the events). The caller
        aborts the request when it stops reading early (a no-op after the end). ``leg``: a prefill or
        decode leg (kv_legs.py); ``timeline``: kept up to date by the step thread (a traced request),
        read by the caller once the stream ended."""
        reader = AsyncTokenStream()
        self._add(request_id, Stream(loop=asyncio.get_running_loop(), reader=reader, timeline=timeline),
                  prompt_token_ids, params, cache_salt, leg, lora_name)
        return reader

    def in_flight(self, request_id: str) -> bool:
        """Whether a stream of this id is open here."""
        with self._lock:
            return request_id in self._streams

    def _add(self, request_id: str, stream: Stream, prompt_token_ids: list[int], params: SamplingParams,
             cache_salt: str, leg: KVLeg | None = None, lora_name: str | None = None) -> None:
        stream.prompt_tokens = len(prompt_token_ids)
        with self._lock:
            if request_id in self._streams:
                raise AlreadyExists(f"request id {excerpt(request_id)} is already in use on this worker; "
                                    "give every request its own id")
            self._streams[request_id] = stream
            if stream.timeline is not None:
                self._traced[request_id] = stream.timeline
        try:
            self.engine.add_request(request_id, prompt_token_ids, params, cache_salt, leg, lora_name)
        except Exception:
            with self._lock:
                self._streams.pop(request_id, None)
                self._traced.pop(request_id, None)
            raise
        self._wake.set()

    def _iterate(self, request_id: str, stream: Stream) -> Iterator[list[TokenEvent]]:
        q = stream.queue
        assert q is not None
        try:
            while True:
                batch = q.get()
                while batch[-1].token_id is not None:
                    try:
                        batch.extend(q.get_nowait())
                    except queue.Empty:
                        break
                yield batch
                if batch[-1].token_id is None:
                    return
        finally:
            # NOTE: a consumer that stops early (client cancel) aborts the request, so its blocks
            # are freed at the next step; a finished request's abort is a no-op.
            self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._traced.pop(request_id, None)
        if stream is None:
            return False
        # NOTE: read before the abort takes the request out of the scheduler; an output already
        # delivered says it too (the step thread's write), else the engine's request does.
        cached = stream.cached_tokens if stream.cached_tokens >= 0 else self.engine.num_cached_tokens(request_id)
        aborted = self.engine.abort_request(request_id)
        # NOTE: tokens held back by stream_interval are dropped: an aborted stream's reader is gone.
        self._post([(stream, [TokenEvent(None, "abort", stream.prompt_tokens, cached, stream.completion_tokens)])])
        self._wake.set()
        return aborted

    # -- the step thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            if not busy:
                self._sync_sink()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            t0_ns = self._step_ns = time.time_ns() if self._traced else 0
            try:
                outputs = self.engine.step(on_output=self._deliver_now)
            except Exception as exc:  # noqa: BLE001 - fail the batch loudly, keep the worker alive
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            if t0_ns:
                self._trace_step(t0_ns, time.time_ns())
            self._sync_sink()
            if self._on_step is not None:
                self._on_step(outputs, time.monotonic() - t0)

    def _trace_step(self, start_ns: int, end_ns: int) -> None:
        """The step's part in each traced request (its computed and output tokens now)."""
        requests = self.engine.scheduler.requests
        with self._lock:
            traced = list(self._traced.items())
        for rid, timeline in traced:
            r = requests.get(rid)
            if r is not None:
                timeline.step(start_ns, end_ns, r.num_computed_tokens, r.num_output_tokens)

    def _sync_sink(self) -> None:
        events = self.engine.take_kv_events()
        if events:
            self.sink.publish(events)
        if self.sink.wants_snapshot():
            self.sink.publish_snapshot(sorted(self.engine.cached_block_hashes()), self.engine.host_snapshot())

    def _deliver_now(self, outputs: list[RequestOutput]) -> None:
        self._deliver(outputs, time.monotonic())

    @staticmethod
    def _post(ready: list[tuple[Stream, list[TokenEvent]]]) -> None:
        """Hands batches to their readers: queues at once, loops with one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[AsyncTokenStream, list[TokenEvent]]]] = {}
        for stream, batch in ready:
            if stream.queue is not None:
                stream.queue.put(batch)
            else:
                assert stream.loop is not None and stream.reader is not None
                by_loop.setdefault(stream.loop, []).append((stream.reader, batch))
        for loop, items in by_loop.items():
            # NOTE: RuntimeError = the server's loop is closed (shutting down): no reader is left.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_push_all, items)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        ready: list[tuple[Stream, list[TokenEvent]]] = []
        for out in outputs:
            with self._lock:
                stream = self._streams.get(out.request_id)
                if stream is not None and out.finished:
                    del self._streams[out.request_id]
                    self._traced.pop(out.request_id, None)
            if stream is None:
                continue  # aborted meanwhile
            if out.num_cached_tokens >= 0:
                stream.cached_tokens = out.num_cached_tokens
            for tok in out.new_token_ids:
                stream.completion_tokens += 1
                if self._on_token is not None:
                    self._on_token(stream, now)
                if stream.first_token is None:
                    stream.first_token = now
                stream.last_token = now
                stream.pending.append(TokenEvent(tok))
            if out.finished:
                if stream.timeline is not None:  # its last step (the step thread is in it now)
                    end_ns = time.time_ns()
                    stream.timeline.step(self._step_ns or end_ns, end_ns, stream.timeline.prompt_tokens,
                                         stream.completion_tokens)
                    stream.timeline.finished_ns = end_ns
                end = TokenEvent(None, out.finish_reason or "stop", out.num_prompt_tokens,
                                 max(out.num_cached_tokens, 0), stream.completion_tokens)
                if self._on_finish is not None:
                    self._on_finish(stream, end)
                stream.pending.append(end)
            if stream.pending and (out.finished or stream.completion_tokens == 1
                                   or len(stream.pending) >= self.stream_interval):
                ready.append((stream, stream.pending))
                stream.pending = []
        if ready:
            self._post(ready)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for rid, _ in streams:
            self.engine.abort_request(rid)
        self._post([(stream, [TokenEvent(None, "abort", stream.prompt_tokens, max(stream.cached_tokens, 0),
                                         stream.completion_tokens, error=message)]) for _, stream in streams])

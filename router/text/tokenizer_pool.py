"""The threads a model's tokenizer runs on, cheapest deadline first.

A task is submitted with a key, when it should be done were it alone: its arrival plus its cost
(characters left to tokenize at the rate the pool has measured, :meth:`TokenizerPool.deadline`; a
loaded host tokenizes ten times slower than a quiet one). The pool runs the lowest key first, so a
prompt that is mostly cached (a few KB to tokenize) does not wait behind others' 200 KB misses, while
a miss waits behind no task that arrived more than its own cost after it (no starvation: the key
only grows with arrival). No grpc, no asyncio: futures are ``concurrent.futures`` ones.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

CHARS_PER_SECOND = 1_000_000
"""The rate a pool starts from: about what one quiet core tokenizes (byte-level BPE, 220 KB in ~0.2 s)."""
RATE_MIN_CHARS = 16384
"""Texts shorter than this do not move the measured rate (fixed costs would dominate)."""
RATE_WEIGHT = 0.2
"""The weight of the latest measure in the rate's moving average."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class TokenizerPool(Executor):
    """``threads`` daemon threads serving a priority queue; ``submit`` (the Executor interface, so
    ``loop.run_in_executor`` works) keys a task by now, :meth:`submit_at` by a given key."""

    def __init__(self, threads: int, name: str = "kvmesh-tokenize") -> None:
        self.threads = max(1, threads)
        self.chars_per_second = float(CHARS_PER_SECOND)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._closed = False
        self._name = name
        self._start = threading.Lock()
        self._workers: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return self.submit_at(time.monotonic(), fn, *args, **kwargs)

    def submit_at(self, key: float, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """``fn(*args, **kwargs)`` once every task of a lower key has started."""
        if self._closed:
            raise RuntimeError("the tokenizer pool is shut down")
        if not self._workers:
            self._start_threads()
        fut: Future = Future()
        self._queue.put((key, next(self._order), fut, fn, args, kwargs))
        return fut

    def _start_threads(self) -> None:
        """On the first task (a model that never gets a long text costs no threads)."""
        with self._start:
            if self._workers:
                return
            workers = [threading.Thread(target=self._serve, name=f"{self._name}-{i}", daemon=True)
                       for i in range(self.threads)]
            for t in workers:
                t.start()
            self._workers = workers

    def deadline(self, chars: int, arrival: float) -> float:
        """The key of a task that tokenizes ``chars`` characters for a request that arrived at ``arrival``."""
        return arrival + chars / self.chars_per_second

    def observe(self, chars: int, seconds: float) -> None:
        """A text of ``chars`` characters took ``seconds`` on a pool thread (its wall time: a loaded host's too)."""
        if chars >= RATE_MIN_CHARS and seconds > 0:
            self.chars_per_second += RATE_WEIGHT * (chars / seconds - self.chars_per_second)

    def _serve(self) -> None:
        while True:
            _, _, fut, fn, args, kwargs = self._queue.get()
            if fut is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                fut.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item[2] is not None:
                    item[2].cancel()
        for _ in self._workers:
            self._queue.put((float("inf"), next(self._order), None, None, (), {}))
        if wait:
            for t in self._workers:
                t.join()

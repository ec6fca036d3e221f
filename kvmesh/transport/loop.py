"""The event loop a server runs on: uvloop (or asyncio's), on a thread of its own (the main thread
keeps signal handling; tests run several servers in one process, each on its own loop)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOP_ENV = "KVMESH_EVENT_LOOP"
"""``uvloop`` (the default where it is installed) or ``asyncio``: every server loop's implementation."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop of the implementation ``$KVMESH_EVENT_LOOP`` names: uvloop unless it says
    ``asyncio`` or uvloop is not installed (docs/architecture.md)."""
    kind = os.environ.get(EVENT_LOOP_ENV, "")
    if kind not in ("", "asyncio", "uvloop"):
        raise ValueError(f"${EVENT_LOOP_ENV} must be 'asyncio' or 'uvloop', got {kind!r}")
    if kind != "asyncio":
        # NOTE: measured side by side (docs/benchmarks.md, "Control plane on asyncio"): a grpc.aio
        # round trip and a Lookup take 15-45 % less time on uvloop than on asyncio's own loop.
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """An event loop running on a daemon thread; ``run`` executes a coroutine on it and waits."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # NOTE: whatever is still pending (a stream the client never closed) is cancelled so
        # its finally blocks run before the loop closes.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"the event loop of {self._thread.name} has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class LoopServer:
    """A server whose parts run on one :class:`LoopThread` (``self._loop``): the synchronous stop of
    the kv_service's and the router's servers. A subclass writes ``_stop(grace)``, the coroutine that
    drains and closes what it holds."""

    _loop: LoopThread

    async def _stop(self, grace: float) -> None:
        raise NotImplementedError

    def stop(self, grace: float = 2.0) -> None:
        """Drains open calls for up to ``grace`` seconds, closes what the server holds (``_stop``),
        then its loop; a second stop does nothing."""
        if not self._loop.running:
            return
        self._loop.run(self._stop(grace))
        self._loop.stop()

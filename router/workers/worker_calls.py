"""Calls to workers: one gRPC channel per kvmesh worker address (Worker.Generate streams as
WorkerChunks), one HTTP session for the workers served over the OpenAI API (openai_worker.py).

The one place the router reads the status codes of worker calls: they become router/core/upstream.py's
Failure kinds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc

from kvmesh.contract.convert import PB_TO_FINISH, kv_source_from_pb, usage_from_pb
from kvmesh.router.core.upstream import (
    Failure,
    WorkerChunk,
    WorkerEndpoint,
    WorkerError,
)
from kvmesh.router.workers.openai_worker import new_session
from kvmesh.transport.channels import dial_aio
from kvmesh.v1 import worker_pb2_grpc as w_grpc

FAILURE_OF: dict[grpc.StatusCode, Failure] = {
    grpc.StatusCode.INVALID_ARGUMENT: Failure.INVALID,
    grpc.StatusCode.UNAVAILABLE: Failure.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.BUSY,
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.TIMEOUT,
    grpc.StatusCode.CANCELLED: Failure.CANCELLED,
}
CHANNEL_IDLE_S = 900.0
"""A worker channel unused and out of the worker set this long is closed."""


class GrpcWorkerCall:
    """A Worker.Generate stream; iteration yields WorkerChunks and raises WorkerError."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, endpoint: WorkerEndpoint) -> None:
        self._call = call
        self._endpoint = endpoint

    async def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        try:
            async for m in self._call:
                if not m.finish_reason:
                    yield WorkerChunk(list(m.token_ids), None, None, m.worker_id)
                    continue
                yield WorkerChunk(
                    list(m.token_ids),
                    PB_TO_FINISH.get(m.finish_reason),
                    usage_from_pb(m.usage) if m.HasField("usage") else None,
                    m.worker_id,
                    kv_source_from_pb(m.kv_source) if m.HasField("kv_source") else None,
                    m.kv_transport, m.kv_blocks_pulled, m.kv_bytes_pulled, m.kv_pull_seconds,
                )
        except grpc.aio.AioRpcError as exc:
            failure = FAILURE_OF.get(exc.code(), Failure.OTHER)
            if failure is Failure.CANCELLED:
                # NOTE: this router cancels a call only when it stops reading it (its task was
                # cancelled); a CANCELLED status read here came from the worker (e.g. shutting down).
                failure = Failure.UNAVAILABLE
            raise WorkerError(failure, f"{exc.code().name}: {exc.details()}", exc.details() or "") from None

    def cancel(self) -> None:
        self._call.cancel()


class WorkerChannels:
    """One aio channel per worker address, and one HTTP session for the workers served over the
    OpenAI API (router/workers/openai_worker.py), shared by every model's pool; build it on the router's loop.

    Args:
        on_down: told the address of a worker whose channel went to TRANSIENT_FAILURE (a connection
            refused or reset), with no request needed: a channel that lost its connection (IDLE) is
            asked to connect again at once, so a worker that died between requests is seen dead.
    """

    def __init__(self, on_down: Callable[[str], None] | None = None) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, w_grpc.WorkerStub, float]] = {}
        self._http = None
        self._on_down = on_down
        self._watches: dict[str, asyncio.Task] = {}

    def http(self):
        """The aiohttp session (made on first use, on the router's loop)."""
        if self._http is None:
            self._http = new_session()
        return self._http

    def stub(self, address: str) -> w_grpc.WorkerStub:
        entry = self._channels.get(address)
        if entry is None:
            channel = dial_aio(address)
            entry = (channel, w_grpc.WorkerStub(channel), time.monotonic())
            if self._on_down is not None:
                self._watches[address] = asyncio.get_running_loop().create_task(self._watch(address, channel))
        else:
            entry = (entry[0], entry[1], time.monotonic())
        self._channels[address] = entry
        return entry[1]

    async def _watch(self, address: str, channel: grpc.aio.Channel) -> None:
        """Follows one channel's state while its worker is live: IDLE after READY (the connection went) asks
        for a new connection; TRANSIENT_FAILURE (it was refused) is reported, once per failure."""
        assert self._on_down is not None
        C = grpc.ChannelConnectivity
        state = channel.get_state(try_to_connect=False)
        while state is not C.SHUTDOWN:
            await channel.wait_for_state_change(state)
            was, state = state, channel.get_state(try_to_connect=False)
            if state is C.IDLE and was is C.READY:
                state = channel.get_state(try_to_connect=True)
            elif state is C.TRANSIENT_FAILURE:
                self._on_down(address)

    def _unwatch(self, address: str) -> None:
        task = self._watches.pop(address, None)
        if task is not None:
            task.cancel()

    async def prune(self, live: set[str]) -> None:
        """Closes channels out of ``live`` and unused for CHANNEL_IDLE_S; stops watching those out of it."""
        for address in [a for a in self._watches if a not in live]:
            self._unwatch(address)
        now = time.monotonic()
        stale = [a for a, (_, _, used) in self._channels.items() if a not in live and now - used > CHANNEL_IDLE_S]
        for address in stale:
            await self._channels.pop(address)[0].close()

    async def close(self) -> None:
        for address in list(self._watches):
            self._unwatch(address)
        channels, self._channels = self._channels, {}
        for channel, _, _ in channels.values():
            await channel.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

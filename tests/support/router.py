"""The request path's upstream, faked (tests/router/): workers that play a script, and an index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvmesh.contract.index_protocol import IndexUnavailable, Reservation, ReservationAnswer, WorkerMatch
from kvmesh.contract.types import Load, ModelSpec
from kvmesh.router.core.upstream import WorkerChunk, WorkerEndpoint, WorkerError, WorkerRequest

SPEC = ModelSpec("m", 4, "sha256_128")


class FakeCall:
    def __init__(self, script: list) -> None:
        self.script = script
        self.cancelled = False

    async def __aiter__(self) -> AsyncIterator[WorkerChunk]:
        for item in self.script:
            if isinstance(item, WorkerError):
                raise item
            if item == "hang":
                await asyncio.Event().wait()  # a worker that never answers
            if callable(item):
                item()  # a side effect at this point of the stream (a worker joins, ...)
                continue
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class FakePool:
    discovers_from_index = True
    problem = ""

    def __init__(self, scripts: dict[str, list]) -> None:
        self.scripts = scripts
        self.calls: list[str] = []
        self.request_ids: list[str] = []
        self.unhealthy: set[str] = set()
        self.requests: list[WorkerRequest] = []

    def endpoints(self) -> list[WorkerEndpoint]:
        return [WorkerEndpoint(w, f"{w}:1") for w in self.scripts]

    def model_spec(self) -> ModelSpec:
        return SPEC

    def healthy(self, worker_id: str) -> bool:
        return worker_id not in self.unhealthy

    def mark_unhealthy(self, worker_id: str) -> None:
        self.unhealthy.add(worker_id)

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest, timeout_s: float) -> FakeCall:
        self.calls.append(endpoint.worker_id)
        self.request_ids.append(request.request_id)
        self.requests.append(request)
        self.last_call = FakeCall(self.scripts[endpoint.worker_id])
        return self.last_call


class FakeIndex:
    def __init__(self, matched: dict[str, int] | None = None, down: bool = False) -> None:
        self.matched = matched or {}
        self.down = down
        self.reservations: list[Reservation] = []

    async def lookup(self, model_id: str, block_hashes) -> list[WorkerMatch]:
        if self.down:
            raise IndexUnavailable("kv_service at x: UNAVAILABLE")
        return [WorkerMatch(w, f"{w}:1", n, Load()) for w, n in self.matched.items()]

    async def reserve(self, reservation: Reservation) -> ReservationAnswer:
        """The one router here never meets another's pick: every reservation is granted."""
        self.reservations.append(reservation)
        return ReservationAnswer(True)


async def collect(stream: AsyncIterator) -> list:
    return [o async for o in stream]

"""The load generator: sends BenchRequests to a router on schedule and records what came back.

One asyncio loop on grpc.aio drives every request, so thousands of streams cost one thread; a
request is sent at its arrival time (``arrival_s``) and, with ``max_concurrency``, only while
fewer than that many are in flight (vLLM's semaphore).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvmesh.bench.datasets import BenchRequest
from kvmesh.client import make_request
from kvmesh.replay.records import RequestRecord
from kvmesh.transport.channels import CHANNEL_OPTIONS, replicas, resolve_target
from kvmesh.v1 import router_pb2_grpc as pb_grpc


class Progress:
    """A one-line progress bar on stderr (no dependency); silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, label: str = "requests") -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.enabled = enabled and total > 0
        self.label = label
        self._t0 = time.monotonic()
        self._last = 0.0

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.2 or self.done == self.total):
            self._last = now
            width = 30
            fill = int(width * self.done / self.total)
            sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                             f"failed {self.failed} {now - self._t0:5.0f}s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _one(stub: pb_grpc.RouterStub, req: BenchRequest, ignore_eos: bool, t0: float, timeout: float,
               index: int) -> RequestRecord:
    ids = req.prompt_token_ids.tolist() if isinstance(req.prompt_token_ids, np.ndarray) else list(req.prompt_token_ids)
    rec = RequestRecord(index, time.perf_counter() - t0, len(ids), req.output_len)
    msg = make_request(ids, max_tokens=req.output_len, ignore_eos=ignore_eos, request_id=f"bench-{index}")
    last = None
    try:
        async for chunk in stub.Generate(msg, timeout=timeout):
            now = time.perf_counter() - t0
            if chunk.token_ids:
                if last is None:
                    rec.first_token = now
                else:
                    rec.itl.append(now - last)
                last = now
                rec.completion_tokens += len(chunk.token_ids)
            if chunk.finish_reason:
                rec.finish = now
                rec.cached_tokens = chunk.usage.cached_tokens
                rec.worker = chunk.served_by
    except grpc.aio.AioRpcError as exc:
        if rec.finish is None:  # NOTE: a stream that failed after its finish reason still served the request
            rec.failed = f"{exc.code().name}: {exc.details()}"
    return rec


async def run_requests(target: str, requests: Sequence[BenchRequest], *, max_concurrency: int | None = None,
                       ignore_eos: bool = True, timeout: float = 3600.0, progress: bool = True
                       ) -> tuple[list[RequestRecord], float]:
    """Sends every request at its ``arrival_s`` (0 when None); returns the records and the wall duration."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = Progress(len(requests), progress)
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS + lb)
                for address, lb in (resolve_target(t) for t in replicas(target))]
    try:
        stubs = [pb_grpc.RouterStub(c) for c in channels]
        t0 = time.perf_counter()

        async def send(i: int, req: BenchRequest) -> RequestRecord:
            delay = (req.arrival_s or 0.0) - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            stub = stubs[i % len(stubs)]
            if sem is None:
                rec = await _one(stub, req, ignore_eos, t0, timeout, i)
            else:
                async with sem:
                    rec = await _one(stub, req, ignore_eos, t0, timeout, i)
            bar.update(rec.success)
            return rec

        records = await asyncio.gather(*(send(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - t0
    finally:
        for c in channels:
            await c.close()
    return list(records), duration



def run(target: str, requests: Sequence[BenchRequest], **kwargs) -> tuple[list[RequestRecord], float]:
    """:func:`run_requests` on a fresh event loop."""
    return asyncio.run(run_requests(target, requests, **kwargs))

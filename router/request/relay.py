"""One attempt on one worker: its stream relayed to the client as text deltas, stop strings applied, its
in-flight share held from the first byte sent to the last byte received.

Raises WorkerError before the attempt's first chunk (the attempt loop, forward.py, then tries another
worker) and Cut after it: the worker failed mid-stream, and forward.py continues the stream on another
worker from what the client was already sent (``Sent``), or ends it with Unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.contract.types import Usage
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import (
    Failure,
    WorkerChunk,
    WorkerEndpoint,
    WorkerError,
    WorkerPool,
    WorkerRequest,
)
from kvmesh.router.generate_types import GenerateOutput
from kvmesh.router.request.context import RequestContext
from kvmesh.router.request.settle import Settle
from kvmesh.router.text.detokenize import IncrementalDetokenizer
from kvmesh.router.text.stop_strings import StopStrings

log = logging.getLogger("kvmesh.router")

ABORT_DRAIN_S = 2.0
"""After a stop string, how long the worker's final message (with the request's usage) is awaited."""


@dataclass(slots=True)
class Sent:
    """What the client was sent so far, across the attempts of one request: a migrated stream goes on
    from here (the same detokenizer and stop strings, the token ids to continue from)."""

    prompt_len: int
    """The client's prompt, in tokens (a continuation's prompt also holds the tokens sent)."""
    detok: IncrementalDetokenizer | None = None
    stops: StopStrings | None = None
    token_ids: list[int] = field(default_factory=list)
    """The completion's token ids sent, while the prompt and they fit the migration length (``kept``)."""
    completion: int = 0
    """Tokens sent."""
    kept: bool = True
    """``token_ids`` is the whole completion (False past --migration-max-seq-len: no migration then)."""
    migrations: int = 0

    def add(self, ids: Sequence[int], keep_up_to: int) -> None:
        self.completion += len(ids)
        if self.kept and (keep_up_to <= 0 or self.prompt_len + self.completion <= keep_up_to):
            self.token_ids.extend(ids)
        else:
            self.kept, self.token_ids = False, []


class Cut(Exception):
    """The worker failed after the attempt's first chunk: the client already holds part of the stream."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


class Relay:
    """Args:
    core: the router's decision state (the attempt's in-flight share).
    pool: the model's workers.
    settle: the finished request's audit and counts.
    decode: token ids -> text (None: no tokenizer at the router; no text, no stop strings).
    first_token_s: ``--first-token-timeout`` (0: the whole budget).
    keep_up_to: ``--migration-max-seq-len``: prompt plus completion tokens kept for a migration (0: all).
    """

    def __init__(self, core: RoutingCore, pool: WorkerPool, settle: Settle,
                 decode: Callable[[Sequence[int]], str] | None, first_token_s: float, keep_up_to: int = 0) -> None:
        self.core = core
        self.pool = pool
        self.settle = settle
        self.decode = decode
        self.first_token_s = first_token_s
        self.keep_up_to = keep_up_to

    def sent(self, ctx: RequestContext, prompt_len: int) -> Sent:
        """A request's stream state, before its first attempt."""
        inp = ctx.inp
        detok = IncrementalDetokenizer(self.decode) if self.decode is not None else None
        stops = StopStrings(inp.stop, inp.include_stop_str_in_output) if inp.stop and detok is not None else None
        return Sent(prompt_len, detok, stops)

    async def stream(self, ctx: RequestContext, endpoint: WorkerEndpoint, request: WorkerRequest,
                     timeout_s: float, sent: Sent) -> AsyncIterator[GenerateOutput]:
        plan = ctx.plan
        ticket = self.core.start(plan, endpoint.worker_id)
        detok, stops = sent.detok, sent.stops
        completion = 0
        started = False
        call = None
        try:
            call = self.pool.generate(endpoint, request, timeout_s)
            chunks = call.__aiter__()
            chunk = await self._first(chunks, timeout_s)
            started = True
            self.core.prefilled(ticket)
            while True:
                if stops is None:
                    ids: Sequence[int] = chunk.token_ids
                    text = detok.push(ids) if detok is not None else ""
                else:
                    assert detok is not None
                    # NOTE: token by token, so the output ends at the token that completed the stop.
                    ids, text = [], ""
                    for t in chunk.token_ids:
                        ids.append(t)
                        text += stops.push(detok.push([t]))
                        if stops.matched is not None:
                            break
                completion += len(ids)
                sent.add(ids, self.keep_up_to)
                if stops is not None and stops.matched is not None:
                    usage = await self._end_at_stop(endpoint, request, chunks, sent)
                    if not sent.migrations:
                        self.settle.audit(plan, endpoint.worker_id, usage)
                    yield GenerateOutput(ids, text, "stop", usage, endpoint.worker_id)
                    return
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason
                    if detok is not None:
                        tail = detok.flush()
                        if stops is not None:
                            tail = stops.push(tail)
                            finish = "stop" if stops.matched is not None else finish
                            tail += stops.flush()
                        text += tail
                    usage = chunk.usage
                    if sent.migrations:
                        # NOTE: the plan's prediction was for the client's prompt on the first pick: a
                        # continuation is not audited; its usage is the client's prompt and whole completion.
                        usage = Usage(sent.prompt_len, min(usage.cached_tokens, sent.prompt_len) if usage else 0,
                                      sent.completion)
                    else:
                        self.settle.audit(plan, endpoint.worker_id, chunk.usage, chunk.kv_blocks_pulled)
                        if request.kv_source is not None:
                            usage = self.settle.decode_leg(ctx, endpoint.worker_id, chunk)
                    yield GenerateOutput(ids, text, finish, usage, chunk.worker_id or endpoint.worker_id)
                    return
                yield GenerateOutput(ids, text)
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    raise WorkerError(Failure.OTHER, "the stream ended without a finish reason") from None
        except WorkerError as exc:
            if not started or exc.failure is Failure.CANCELLED:
                raise
            log.warning("request %s: worker %s at %s failed mid-stream after %d tokens: %s (%s)", request.request_id,
                        endpoint.worker_id, endpoint.address, sent.completion, exc.failure.value, exc)
            raise Cut(exc.failure, f"{endpoint.worker_id}: {exc}") from None
        finally:
            self.core.finish(ticket, completion)
            if call is not None:
                call.cancel()  # a no-op once the call has ended; frees it when the client left

    async def _first(self, chunks: AsyncIterator[WorkerChunk], timeout_s: float) -> WorkerChunk:
        """The first chunk; a worker that sits on a request is given up on while there is still time to retry
        elsewhere (the call's own deadline is the whole request budget)."""
        first_token_s = self.first_token_s
        try:
            if 0 < first_token_s < timeout_s:
                return await asyncio.wait_for(chunks.__anext__(), first_token_s)
            return await chunks.__anext__()
        except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError only from Python 3.11
            raise WorkerError(Failure.TIMEOUT, f"no first token within {first_token_s:g}s "
                                               "(--first-token-timeout)") from None
        except StopAsyncIteration:
            raise WorkerError(Failure.OTHER, "the stream ended without a finish reason") from None

    async def _end_at_stop(self, endpoint: WorkerEndpoint, request: WorkerRequest,
                           chunks: AsyncIterator[WorkerChunk], sent: Sent) -> Usage:
        """A stop string ended the text: the worker is told to abort, and its last message (which carries the
        prompt's cached tokens) is awaited for at most ABORT_DRAIN_S."""
        usage = None
        if await self.pool.abort(endpoint, request.request_id):
            async def last() -> Usage | None:
                async for c in chunks:
                    if c.finish_reason is not None:
                        return c.usage
                return None

            with contextlib.suppress(asyncio.TimeoutError, WorkerError):  # noqa: UP041 - 3.10's TimeoutError
                usage = await asyncio.wait_for(last(), ABORT_DRAIN_S)
        cached = min(usage.cached_tokens, sent.prompt_len) if usage is not None else 0
        return Usage(sent.prompt_len, cached, sent.completion)

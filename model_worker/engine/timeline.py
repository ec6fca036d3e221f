"""A traced request's life on the engine thread, as plain timestamps (docs/tracing.md).

Kept only for requests that arrive with a trace (the router's ``traceparent``) while tracing is on; the
engine loop (engine_loop.py) updates it after each step the request took part in, and the server turns it
into spans when the request ends (model_worker/serving/server.py): the wait in the queue, each prefill
chunk, the first token, the decode windows and the finish. Wall-clock ns, since spans carry wall time.

This module imports neither grpc nor redis (nor OpenTelemetry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECODE_WINDOW_TOKENS = 16
"""Tokens per decode-window span: a span per token would cost more than the token."""


@dataclass(slots=True)
class RequestTimeline:
    arrival_ns: int
    prompt_tokens: int
    scheduled_ns: int | None = None
    """The start of the first step that computed any of it (the end of its wait in the queue)."""
    prefill: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, tokens) of each step that computed prompt tokens."""
    decode: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, end, tokens) of each decode window of up to DECODE_WINDOW_TOKENS tokens."""
    first_token_ns: int | None = None
    finished_ns: int | None = None
    computed: int = 0
    outputs: int = 0

    def step(self, start_ns: int, end_ns: int, computed: int, outputs: int) -> None:
        """A step ended in which the request's computed tokens reached ``computed`` and its outputs ``outputs``."""
        if computed <= self.computed and outputs <= self.outputs:
            return  # not scheduled in this step
        if self.scheduled_ns is None:
            self.scheduled_ns = start_ns
        if self.computed < self.prompt_tokens:
            self.prefill.append((start_ns, end_ns, min(computed, self.prompt_tokens) - self.computed))
        new = outputs - self.outputs
        if new > 0:
            if self.first_token_ns is None:
                self.first_token_ns = end_ns
                new -= 1
            if new > 0:
                last = self.decode[-1] if self.decode else None
                if last is not None and last[2] < DECODE_WINDOW_TOKENS:
                    self.decode[-1] = (last[0], end_ns, last[2] + new)
                else:
                    self.decode.append((start_ns, end_ns, new))
        self.computed = max(self.computed, computed)
        self.outputs = max(self.outputs, outputs)

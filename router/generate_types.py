"""What a front end hands the request path and gets back: :class:`GenerateInput` (with a
:class:`ChatInput` for a conversation) in, :class:`GenerateOutput` per streamed step out. The types only;
the request path that consumes them is model_router.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.contract.types import SamplingParams, TraceContext, Usage
from kvmesh.router.core.policies.base import NO_OBJECTIVES, Objectives


@dataclass(slots=True, frozen=True)
class ChatInput:
    """A conversation for the model's chat template (router/text/chat_template.py)."""

    messages: Sequence[Mapping[str, Any]]
    """``{"role", "content"[, "name"]}`` each, content as text."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra template variables (vLLM's ``chat_template_kwargs``)."""


@dataclass(slots=True, frozen=True)
class GenerateInput:
    """A client request, already converted from protobuf or JSON; exactly one of text / token_ids /
    chat is set."""

    text: str | None
    token_ids: Sequence[int] | None
    sampling: SamplingParams
    cache_salt: str = ""
    request_id: str = ""
    timeout_s: float | None = None
    """Time the client has left (its gRPC deadline); None = no client deadline."""
    chat: ChatInput | None = None
    stop: Sequence[str] = ()
    """Stop strings (router/text/stop_strings.py); they need the model's tokenizer."""
    include_stop_str_in_output: bool = False
    trace: TraceContext | None = None
    """The caller's trace context (``traceparent`` and ``tracestate``) when the request path opens the
    request's span itself; None = a trace of its own while tracing is on. The fronts (gRPC, HTTP) open the
    span before they check the request, under the context they extract, and hand the span over instead."""
    objectives: Objectives = NO_OBJECTIVES
    """The request's latency objectives, the router's defaults filled in by the front (router/api/objectives.py)."""
    adapter: str = ""
    """The LoRA adapter the request runs under ("" = the base model): the front resolves a ``model`` that names
    an adapter to its base model's path and this (router/models.py, docs/adapters.md)."""


@dataclass(slots=True, frozen=True)
class GenerateOutput:
    token_ids: Sequence[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    served_by: str = ""
    request_id: str = ""
    """On the first output only: the id the request has in the router's and the worker's logs."""

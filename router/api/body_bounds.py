"""The bounds of an OpenAI request body (router/api/request_body.py streams a body against them,
router/api/whole_body.py walks a small one read whole) and the refusal past its byte limit."""

from __future__ import annotations

from dataclasses import dataclass

MAX_OBJECT_KEYS = 64
"""Fields of one message or content part."""
MAX_OTHER_VALUES = 4096
"""JSON values outside messages, prompt, stop and stop_token_ids (unknown fields included)."""
MAX_DEPTH = 32
WHOLE_BYTES = 64 * 1024
"""A body that arrived whole up to this size is parsed in one ``json.loads`` (well under a millisecond
on the loop); a larger one goes through the slices."""
WHOLE_DEPTH = 8
"""Nesting the whole-body walk follows; deeper documents take the streaming parser."""
YAJL_INT_BOUND = 2**63
"""yajl reads integers in (-2**63, 2**63); past that it reports an overflow."""


class BodyTooLarge(Exception):
    """The body is over the byte limit (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over {limit} bytes (--max-body-bytes)")


@dataclass(slots=True, frozen=True)
class BodyBounds:
    max_bytes: int
    max_messages: int
    max_content_parts: int
    max_prompt_ids: int = 0
    """Token ids in ``prompt``: more than any served model accepts; 0 = bounded by bytes only (a model
    without a prompt-token bound)."""
    max_token_bytes: int = 0
    """Bytes of one JSON string (or number): longer than any prompt could be (6 bytes of JSON escape per
    prompt byte, ``--max-prompt-bytes``); 0 = bounded by bytes only."""

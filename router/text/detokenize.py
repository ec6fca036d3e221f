"""Streaming detokenization: text deltas that never split a UTF-8 character.

Byte-level tokenizers cut multi-byte characters across tokens; decoding a prefix that ends inside
one yields U+FFFD. The detokenizer holds such tokens back until the character is complete, and
decodes with a window of already-emitted tokens in front, because some decoders (SentencePiece's
leading-space rule) render a token differently at the start of a string than after others.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is the decoded text.

    Args:
        decode: ids -> text (e.g. ``lambda ids: tokenizer.decode(ids, skip_special_tokens=True)``).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        # NOTE: ids[prefix:read] were emitted and serve as decoding context; ids[read:] are not yet.
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text they complete ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def flush(self) -> str:
        """The rest at end of stream, even if it ends inside a character (then with U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):] if len(after) > len(before) else ""

"""What a prompt may be, checked before work is spent on it, and text tokenized within those bounds.

Every front end of the router (the gRPC API, the OpenAI HTTP API) builds a ``GenerateInput`` and
calls ``ModelRouter.generate``, which applies these checks, so a bad request gets the same answer
whichever way it came. One client's oversized request must not cost the others anything:

- **ids and salt** (:func:`check_input`): bounded (kvmesh/contract/limits.py), refused before
  anything else.
- **bytes**: a text longer than ``max_bytes`` of UTF-8 is refused before the tokenizer sees any of
  it (RESOURCE_EXHAUSTED naming ``--max-prompt-bytes``).
- **tokens**: a prompt over ``max_tokens`` is refused (INVALID_ARGUMENT when the bound is the
  model's context, RESOURCE_EXHAUSTED naming ``--max-prompt-tokens`` when an operator set it);
  token ids are counted before they are hashed, text is tokenized in pieces that stop once the
  count is past the bound (:meth:`PromptTokenizer.encode`).
- **the loop**: a text longer than ``TOKENIZE_ON_LOOP_CHARS`` is tokenized on a thread of this
  router's tokenizer pool (router/text/tokenizer_pool.py: one thread per usable core, cheapest
  deadline first) with ``encode_batch``, which releases the GIL (``Tokenizer.encode`` does
  not: a 5 MB text held every other request on the loop for seconds); a conversation of more than
  ``RENDER_ON_LOOP_MESSAGES`` messages or ``TOKENIZE_ON_LOOP_CHARS`` characters is rendered by its
  chat template on the same pool (router/model_router.py), so its Python work is spread by the GIL's
  switch interval instead of holding the loop in one piece.
- **text seen before**: a long text sharing a long prefix with one tokenized before is spliced onto
  its cached ids and only the rest is tokenized, with exactly the ids of a whole encode
  (router/text/prefix_tokens.py, which says why).

No grpc and no redis here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.contract.errors import InvalidArgument, RequestTooLarge
from kvmesh.contract.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_CHAIN_BLOCKS,
    MAX_REQUEST_ID_CHARS,
    MAX_TOKEN_ID,
    check_id,
    check_length,
    excerpt,
)
from kvmesh.router.text.prefix_tokens import DEFAULT_CACHE_BYTES, PrefixTokenCache, Splice
from kvmesh.router.text.tokenizer_pool import TokenizerPool, usable_cores

BYTES_PER_TOKEN = 32
"""Default ``--max-prompt-bytes`` per token of the prompt-token bound. Text averages 3-5 bytes a
token; 32 leaves room for code and odd scripts while a 5 MB text to a 32k-context model is refused
without tokenizing it."""
TOKENIZE_ON_LOOP_CHARS = 2048
"""Texts up to this long are tokenized on the event loop (well under a millisecond)."""
ONE_PASS_BYTES_PER_TOKEN = 4
"""A text of at most this many bytes per allowed token is tokenized in one pass: it costs no more
than the longest prompt that fits. A longer one is counted in pieces first, stopping past the bound."""
MIN_PIECE_CHARS = 4096
PIECE_SLACK_TOKENS = 4
"""Tokens one cut between two pieces may add to their count (merges a cut prevents, a prefix space)."""
MIN_TOKENIZER_THREADS = 2
"""Threads tokenizing long texts (and rendering long conversations) at once: one per usable core, at
least this many (a long text in the tokenizer does not hold the GIL, so a second thread lets another
text start on one core too); more wait their turn (never the loop's)."""
QUICK_CHARS = 16384
"""A text with at most this much left to tokenize past its cached prefix is tokenized in the same
turn on the pool as its lookup (~16 ms at most ahead of its deadline's place in the queue)."""
RENDER_ON_LOOP_MESSAGES = 16
"""Conversations of up to this many messages (and TOKENIZE_ON_LOOP_CHARS characters) are rendered on
the event loop (well under a millisecond)."""


def check_prompt_ids(token_ids: Sequence[int], what: str, vocab_size: int = 0, model: str = "") -> None:
    """Raises InvalidArgument (``param`` = ``what``) naming the first id outside [0, 2**31) (token ids
    are hashed as int32, docs/block-hashing.md, and sent to the worker as uint32), or, with
    ``vocab_size``, the first at or past it: the engine would refuse it (vLLM: "Token id N is out of
    vocabulary"), and it is the client's to fix, not a worker fault to retry elsewhere (issue 35).

    NOTE: one numpy copy of the ids answers both in microseconds: a protobuf repeated field becomes
    an array at memory speed (2 us for 4,096 ids), where ``min``/``max`` over it cost ~0.6 ms."""
    if not token_ids:
        return
    try:
        ids = np.asarray(token_ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        ids = None  # NOTE: past int64 (JSON allows it) or not all integers: named one by one below
    hi = min(MAX_TOKEN_ID, vocab_size) if vocab_size else MAX_TOKEN_ID
    if ids is not None and ids.ndim == 1 and (not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < hi)):
        return
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or not 0 <= t < MAX_TOKEN_ID:
            raise InvalidArgument(f"{what}[{i}] is {excerpt(t)}: token ids are integers in [0, 2**31)", param=what)
        if t >= hi:
            raise InvalidArgument(f"{what}[{i}] is {t}: outside the vocabulary of model {excerpt(model)} (ids 0 to "
                                  f"{vocab_size - 1})", param=what)


def check_message_count(n: int, max_messages: int) -> None:
    """Raises RequestTooLarge (400 over HTTP, RESOURCE_EXHAUSTED over gRPC) past ``--max-messages``."""
    if n > max_messages:
        raise RequestTooLarge(f"messages has {n} messages; this router takes at most {max_messages} "
                              "(--max-messages)", param="messages")


def check_input(request_id: str, cache_salt: str) -> None:
    """The bounded fields of a request; raises InvalidArgument."""
    check_id("request_id", request_id, MAX_REQUEST_ID_CHARS, allow_empty=True)
    check_length("cache_salt", cache_salt, MAX_CACHE_SALT_CHARS)


@dataclass(slots=True, frozen=True)
class PromptLimits:
    """The bounds one request is checked against; 0 = none."""

    max_tokens: int = 0
    max_bytes: int = 0
    explicit_tokens: bool = False
    """``max_tokens`` is an operator's ``--max-prompt-tokens`` (RESOURCE_EXHAUSTED past it), not
    the model's context (INVALID_ARGUMENT: no worker could serve it)."""
    why: str = ""
    """Where ``max_tokens`` comes from, for the message."""

    @classmethod
    def resolve(cls, max_prompt_tokens: int | None, max_prompt_bytes: int | None, context_len: int | None,
                block_size: int) -> PromptLimits:
        """The router's flags (None = default) over what it knows of the model.

        Token bound: the flag when set (0 = none); else the model's context length minus one (a
        prompt must leave room for one generated token); else, when the context is unknown, the
        index's Lookup bound (65536 blocks). Byte bound: the flag when set (0 = none); else
        ``BYTES_PER_TOKEN`` per token of the token bound.
        """
        if max_prompt_tokens is not None:
            tokens, explicit, why = max_prompt_tokens, True, "--max-prompt-tokens"
        elif context_len:
            tokens, explicit = context_len - 1, False
            why = f"the model's context is {context_len} tokens, one of them for the output"
        else:
            tokens, explicit = MAX_CHAIN_BLOCKS * block_size, False
            why = f"the index looks up at most {MAX_CHAIN_BLOCKS} blocks of {block_size} tokens"
        if max_prompt_bytes is not None:
            nbytes = max_prompt_bytes
        else:
            nbytes = BYTES_PER_TOKEN * tokens if tokens else 0
        return cls(max(tokens, 0), max(nbytes, 0), explicit, why)

    def check_bytes(self, text: str) -> None:
        """Raises RequestTooLarge (RESOURCE_EXHAUSTED) when ``text`` is over the byte bound; reads at most what it must."""
        limit = self.max_bytes
        if not limit or 4 * len(text) <= limit:
            return
        # NOTE: a character is 1-4 bytes: a text of more characters than the limit is over it
        # without encoding anything; otherwise the encoding is at most 4 x limit bytes.
        n = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
        if n > limit:
            more = "more than " if len(text) > limit else ""
            raise RequestTooLarge(
                f"the text is {more}{n} bytes of UTF-8; this router accepts at most {limit} "
                f"(--max-prompt-bytes): send a shorter prompt", param="prompt")

    def check_tokens(self, n: int, *, more: bool = False) -> None:
        """Raises when a prompt of ``n`` tokens (``more``: more than ``n``) is over the token bound."""
        limit = self.max_tokens
        if not limit or (n <= limit and not more):
            return
        count = f"more than {n}" if more else str(n)
        if self.explicit_tokens:
            raise RequestTooLarge(f"the prompt has {count} tokens; this router accepts at most {limit} "
                                  "(--max-prompt-tokens)", param="prompt")
        raise InvalidArgument(f"the prompt has {count} tokens; at most {limit} fit ({self.why}): "
                              "send a shorter prompt", param="prompt")


class PromptTokenizer:
    """A model's tokenizer used within :class:`PromptLimits`, off the event loop for long texts, with
    the texts tokenized before kept (router/text/prefix_tokens.py).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        on_chars: told how many characters each tokenizer call was given (a metric: a refused
            prompt shows it was not tokenized whole; a cached prefix is not given again).
        on_pool: told +1 when a text goes to the pool, -1 when it is back (a gauge of the texts
            being tokenized off the loop).
        executor: where long texts are tokenized; default: a :class:`TokenizerPool` of ``threads``.
        threads: the default pool's threads; None: one per core this process may use (at least
            ``MIN_TOKENIZER_THREADS``).
        cache_bytes: the bound of the tokenized-prefix cache; 0: no cache.
    """

    def __init__(self, tokenizer: Any, on_chars: Callable[[int], None] = lambda _n: None,
                 on_pool: Callable[[int], None] = lambda _d: None, executor: Executor | None = None,
                 threads: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self._on_chars = on_chars
        self._on_pool = on_pool
        self._own = executor is None
        self._executor = executor or TokenizerPool(
            threads if threads is not None else max(MIN_TOKENIZER_THREADS, usable_cores()))
        self.cache = PrefixTokenCache(tokenizer, cache_bytes)

    async def encode(self, text: str, limits: PromptLimits, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids (by default with the model's special tokens, as the worker's
        offline path encodes; a rendered chat template has them already). Raises
        ResourceExhausted / InvalidArgument past ``limits``."""
        limits.check_bytes(text)
        if len(text) <= TOKENIZE_ON_LOOP_CHARS:
            self._on_chars(len(text))
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            arrival = time.monotonic()
            self._on_pool(1)
            try:
                if _counted_first(text, limits.max_tokens):
                    fits = await self._submit(self._deadline(len(text), arrival), self._fits, text, limits.max_tokens)
                    if not fits:
                        limits.check_tokens(limits.max_tokens, more=True)
                found = await self._submit(arrival, self._lookup, text, add_special_tokens)
                ids = found if isinstance(found, list) else await self._submit(
                    self._deadline(found.chars, arrival), self._tokenize, found, add_special_tokens)
            finally:
                self._on_pool(-1)
        limits.check_tokens(len(ids))
        return ids

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this tokenizer's pool (a long conversation's rendering), counted in ``on_pool``."""
        self._on_pool(1)
        try:
            return await self._submit(time.monotonic(), fn, *args)
        finally:
            self._on_pool(-1)

    def _submit(self, key: float, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        if isinstance(self._executor, TokenizerPool):
            return asyncio.wrap_future(self._executor.submit_at(key, fn, *args))
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _lookup(self, text: str, add_special_tokens: bool) -> list[int] | Splice:
        """On a pool thread: the ids when little is left to tokenize after the cached prefix (no
        second turn in the queue), else the splice, queued again by what it costs."""
        splice = self.cache.lookup(text)
        if splice.chars <= QUICK_CHARS:
            return self.cache.tokenize(splice, add_special_tokens, self._on_chars)
        return splice

    def _tokenize(self, splice: Splice, add_special_tokens: bool) -> list[int]:
        t = time.monotonic()
        ids = self.cache.tokenize(splice, add_special_tokens, self._on_chars)
        if isinstance(self._executor, TokenizerPool):
            self._executor.observe(splice.chars, time.monotonic() - t)
        return ids

    def _deadline(self, chars: int, arrival: float) -> float:
        return self._executor.deadline(chars, arrival) if isinstance(self._executor, TokenizerPool) else arrival

    def _fits(self, text: str, max_tokens: int) -> bool:
        """On a pool thread: False once the text is known to be over ``max_tokens``.

        A text long for its bound is counted piece by piece, cut before whitespace where
        pre-tokenizers split anyway; the count stops as soon as it passes the bound plus the
        slack of the cuts so far. Only a text that fits is then tokenized (whole, or onto a cached
        prefix), so the ids are exactly those of one ``encode``.
        """
        piece = max(MIN_PIECE_CHARS, 2 * max_tokens)
        count = start = cuts = 0
        while start < len(text):
            end = min(len(text), start + piece)
            if end < len(text):
                cut = _last_space(text, start + piece // 2, end)
                if cut > start:
                    end = cut
            chunk = text[start:end]
            self._on_chars(len(chunk))
            count += len(self.tokenizer.encode_batch([chunk], add_special_tokens=False)[0].ids)
            if count > max_tokens + PIECE_SLACK_TOKENS * cuts:
                return False
            start, cuts = end, cuts + 1
        return True

    def close(self) -> None:
        if self._own:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _counted_first(text: str, max_tokens: int) -> bool:
    """A text of more than ``ONE_PASS_BYTES_PER_TOKEN`` bytes per allowed token is counted in pieces
    before it is tokenized: it may be far over the bound."""
    bound = ONE_PASS_BYTES_PER_TOKEN * max_tokens
    if not max_tokens or 4 * len(text) <= bound:
        return False
    # NOTE: 1-4 bytes a character: more characters than the bound is over it without encoding.
    return len(text) > bound or len(text.encode("utf-8", "surrogatepass")) > bound


def _last_space(text: str, lo: int, hi: int) -> int:
    """The index of the last whitespace character in text[lo:hi], or -1."""
    return max(text.rfind(c, lo, hi) for c in (" ", "\n", "\t"))


def check_token_ids(token_ids: Sequence[int], limits: PromptLimits) -> None:
    """A token-id prompt's count against the bound, before anything hashes it."""
    limits.check_tokens(len(token_ids))

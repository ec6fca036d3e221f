"""Texts tokenized before, kept so that a text sharing a long prefix with one of them costs the
tokenizer only its new part, with exactly the ids one whole-text ``encode`` gives.

How a text is tokenized (``tokenizers``): normalize, split out the added tokens, pre-tokenize by a
left-to-right scan (a regex such as GPT-2's, Llama 3's or Qwen2's, or whitespace), then run the model
(BPE, WordPiece, ...) on each pre-token alone, then post-process (BOS, EOS). A cached text keeps its
ids and, about every ``CHECKPOINT_TOKENS`` tokens, a *cut*: a char offset where a pre-token starts
(the encoding's word ids change there) and how many tokens come before it.

A new text ``T`` that shares ``D`` characters with a cached ``T'`` is spliced at a cut ``b`` of
``T'``: ``ids(T) = ids(T')[:tokens before b] + ids(T[b:])``, with ``T[b:]`` tokenized from an earlier
cut ``a``, and the splice accepted only when the verification below holds; otherwise ``T`` is
tokenized whole. Why the splice is exact:

1. *Before b, T and T' are tokenized alike.* A pre-token decision before ``b`` reads only text
   before ``D`` when ``b`` lies at least ``margin`` characters before ``D`` (longer than any added
   token: added tokens are matched first, leftmost-longest, and none starting before ``b`` can reach
   ``D``) and a whitespace character followed by a non-whitespace one lies in ``T[b:D]``. The
   pre-tokenizers this cache accepts (:func:`unsupported_reason`) match runs of one kind (letters,
   digits, punctuation then newlines, whitespace) or bounded literals, so no match that starts
   before ``b`` reads past that non-whitespace character (``\\s*[\\r\\n]+`` over a long run of spaces
   is the case that needs the rule: it reads to the run's end). So ``T`` has a pre-token boundary at
   ``b`` and the same pre-tokens, hence the same ids, before it. NOTE: for a ``Split`` regex "runs
   of one kind" is assumed, not checked (true of GPT-2's, GPT-4's, Llama 3's and Qwen2's); the
   verification below also refuses the one wrong cut the tests could build without the rule.
2. *After b, T is tokenized as T[b:] is.* The scan is memoryless: from a boundary, what it does next
   depends only on the text after it (no lookbehind or anchors; checked in the regex). What could
   still differ at the start of a text (a prefix space, Metaspace's ▁, a normalizer's first
   character) is caught by the verification: ``T[a:]`` is tokenized from the earlier cut ``a`` and
   must re-derive the cached tokens over ``[a, b)`` exactly and have a pre-token boundary at ``b``
   (word ids change, the token starts at ``b``); then its scan at ``b`` has read ``b - a`` characters
   of the same history as the whole text's and continues as it does.
3. *Special tokens* are not cut: the cache holds ids without them (a copy of the tokenizer without
   its post-processor) and adds the head and tail the post-processor adds, probed at construction
   (``encode(p, True) == head + encode(p, False) + tail`` on several probes, or no cache).

Tokenizers this cannot cover are detected and get no cache (:func:`unsupported_reason`): no
pre-tokenizer (one 220 KB "word" for BPE: Llama 2, Mistral, Gemma's sentencepiece BPE), BPE dropout,
truncation or padding set, a pre-tokenizer regex with lookbehind or anchors, normalizers or
pre-tokenizers of kinds not listed. With a Unicode normalizer (NFC: Qwen2) cuts must be before an
ASCII character, which never composes with the one before it.

A lookup hashes the text in ``CHUNK_CHARS`` pieces, chained, and finds the cached text holding the
deepest one; the common prefix is then compared character by character (a hash collision costs a
miss, never a wrong id). Bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHUNK_CHARS = 1024
"""The lookup's granularity: a text is found by its chained chunk hashes."""
MIN_CACHED_CHARS = 2 * CHUNK_CHARS
"""Shorter texts are neither looked up nor kept."""
CHECKPOINT_TOKENS = 64
"""About this many tokens between two cuts of a cached text (what a splice backs off, at most)."""
WINDOW_CHARS = 64
"""The verification window: the tail is tokenized from a cut at least this far before the splice."""
SPACE_START_TRIES = 8
"""For a tokenizer that treats a text's start apart (a prefix space), the tail starts at a cut before a
space when one of this many is."""
MIN_MARGIN_CHARS = 32
"""A splice is at least this far before the first difference (more when added tokens are longer)."""
STORE_NEW_CHARS = 8 * CHUNK_CHARS
"""A spliced text is kept when this much of it is its own (past the cut): less is cheaper to tokenize
again (the next turn of its conversation re-tokenizes it) than to hold another copy of the ids."""
HOLD_GIL_CHARS = 2048
"""Texts up to this long are tokenized with ``encode`` (holds the GIL, well under a millisecond)."""
DEFAULT_CACHE_BYTES = 128 << 20
"""Default bound of one model's cache."""
BYTES_PER_HELD_TOKEN = 40
"""A cached id: a list slot (8) and, conservatively, its own int object (32)."""
PROBES = ("Hello world", "a", "  two  spaces\n\nand lines ", "<s>x</s>", "é漢🙂 mixed 123")

_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Strip", "Prepend", "Replace",
                "Sequence"}
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Sequence", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits",
                   "Metaspace", "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit"}
_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}
_LOOKBEHIND = re.compile(r"\(\?<[=!]|\\[bBAzZG]|(?<!\\)[\^$]")
"""Constructs that read behind a position (or anchor to the text's ends): a scan with them is not memoryless.
NOTE: ``^`` inside a character class (``[^\\s]``) is a negation, not an anchor: classes are removed first."""
_CLASS = re.compile(r"\[(?:\\.|[^\]\\])*\]")


def unsupported_reason(tokenizer: Any) -> str | None:
    """Why ``tokenizer`` cannot be spliced exactly (module docstring), or None when it can."""
    try:
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return "truncation or padding is set"
        cfg = json.loads(tokenizer.to_str())
    except (AttributeError, TypeError, ValueError):
        return "not a tokenizers.Tokenizer"
    model = cfg.get("model") or {}
    if model.get("type") not in _MODELS:
        return f"model {model.get('type')!r}"
    if model.get("dropout") not in (None, 0, 0.0):
        return "BPE dropout makes tokenization random"
    pre = cfg.get("pre_tokenizer")
    if pre is None:
        return "no pre-tokenizer: the whole text is one word for the model"
    for step in _flatten(pre, "pretokenizers"):
        kind = step.get("type")
        if kind not in _PRE_TOKENIZERS:
            return f"pre-tokenizer {kind!r}"
        pattern = (step.get("pattern") or {}).get("Regex")
        if pattern is not None and _LOOKBEHIND.search(_CLASS.sub("", pattern)):
            return f"pre-tokenizer regex {pattern!r} reads behind or anchors"
    for step in _flatten(cfg.get("normalizer"), "normalizers"):
        kind = step.get("type")
        if kind not in _NORMALIZERS or (kind == "Replace" and "Regex" in (step.get("pattern") or {})):
            return f"normalizer {kind!r}"
    return None


def _flatten(step: dict | None, key: str) -> list[dict]:
    if step is None:
        return []
    if step.get("type") == "Sequence":
        return [s for inner in step.get(key) or [] for s in _flatten(inner, key)]
    return [step]


@dataclass(slots=True, eq=False)
class TokenizedText:
    """One cached text: its ids without special tokens and its cuts (ascending, the first at 0)."""

    text: str
    ids: list[int]
    cut_chars: list[int]
    cut_tokens: list[int]
    keys: list[int]
    nbytes: int = 0


@dataclass(slots=True)
class Splice:
    """What :meth:`PrefixTokenCache.lookup` found for a text: tokenize ``text[start:]`` and keep the
    cached ids before the cut (``entry`` None: tokenize the whole text)."""

    text: str
    keys: list[int]
    entry: TokenizedText | None = None
    start: int = 0
    """Char offset ``a`` the tail is tokenized from (a cut of ``entry``)."""
    start_token: int = 0
    cut: int = 0
    """Char offset ``b`` of the splice (a cut of ``entry``)."""
    cut_token: int = 0

    @property
    def chars(self) -> int:
        """Characters left to tokenize."""
        return len(self.text) - self.start


@dataclass(slots=True)
class CacheStats:
    """What a cache did since it was made (the benchmark's and tests' window into it)."""

    hits: int = 0
    """Texts spliced onto a cached prefix."""
    misses: int = 0
    """Texts tokenized whole (no long enough prefix cached)."""
    refused: int = 0
    """Splices the verification refused (tokenized whole instead)."""
    saved_chars: int = 0
    """Characters not tokenized thanks to the cache."""
    entries: int = 0
    bytes: int = 0


class PrefixTokenCache:
    """A model's tokenized texts, bounded by ``max_bytes``; thread-safe (used from the tokenizer pool).

    ``enabled`` is False (and every text is tokenized whole) when :func:`unsupported_reason` names a
    reason, kept in ``disabled_reason``.
    """

    def __init__(self, tokenizer: Any, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.disabled_reason = unsupported_reason(tokenizer) if max_bytes > 0 else "no cache bytes"
        self._core = tokenizer
        self._head: list[int] = []
        self._tail: list[int] = []
        self.margin = MIN_MARGIN_CHARS
        self.ascii_cuts = False
        self.space_starts = False
        if self.disabled_reason is None:
            self.disabled_reason = self._prepare()
        self.enabled = self.disabled_reason is None
        self._lock = threading.Lock()
        self._lru: OrderedDict[int, TokenizedText] = OrderedDict()
        self._index: dict[int, TokenizedText] = {}
        self._bytes = 0
        self.stats = CacheStats()

    def _prepare(self) -> str | None:
        """The core tokenizer (no post-processor), the special tokens' head and tail, the margin."""
        from tokenizers import Tokenizer

        core = Tokenizer.from_str(self.tokenizer.to_str())
        core.post_processor = None
        heads: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for probe in PROBES:
            plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
            if core.encode(probe, add_special_tokens=False).ids != plain:
                return "the post-processor changes ids without special tokens"
            full = self.tokenizer.encode(probe, add_special_tokens=True).ids
            at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), -1)
            if at < 0:
                return "special tokens are not only a head and a tail"
            heads.add((tuple(full[:at]), tuple(full[at + len(plain):])))
        if len(heads) != 1:
            return "special tokens differ by text"
        (head, tail), = heads
        self._core, self._head, self._tail = core, list(head), list(tail)
        added = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        self.margin = max([MIN_MARGIN_CHARS, *(len(c) + 1 for c in added)])
        cfg = json.loads(self.tokenizer.to_str())
        word = core.encode("word", add_special_tokens=False).ids
        self.space_starts = core.encode("\nword", add_special_tokens=False).ids[-len(word):] != word
        self.ascii_cuts = any(s.get("type") in _UNICODE_FORMS for s in _flatten(cfg.get("normalizer"), "normalizers"))
        return None

    # -- the two steps: lookup (cheap: what is left to tokenize), then tokenize ---------------------
    def lookup(self, text: str) -> Splice:
        """Where ``text`` can be spliced onto a cached one (``entry`` None: nowhere)."""
        if not self.enabled or len(text) < MIN_CACHED_CHARS:
            return Splice(text, [])
        keys = chunk_keys(text)
        entry, depth = None, 0
        with self._lock:
            for d in range(len(keys) - 1, -1, -1):
                entry = self._index.get(keys[d])
                if entry is not None:
                    depth = d + 1
                    self._lru.move_to_end(id(entry))
                    break
        if entry is None:
            return Splice(text, keys)
        shared = common_prefix(text, entry.text, depth * CHUNK_CHARS)
        return self._plan(Splice(text, keys), entry, shared)

    def _plan(self, splice: Splice, entry: TokenizedText, shared: int) -> Splice:
        text = splice.text
        if shared == len(text) == len(entry.text):
            splice.entry, splice.start = entry, len(text)
            splice.start_token = splice.cut_token = len(entry.ids)
            splice.cut = len(text)
            return splice
        limit = min(shared - self.margin, last_space_before_word(text, shared))
        i = _last_cut(entry, limit, text, self.ascii_cuts)
        if i <= 0:
            return splice
        j = _last_cut(entry, entry.cut_chars[i] - WINDOW_CHARS, text, self.ascii_cuts)
        if j < 0:
            return splice
        if self.space_starts:  # NOTE: a tail starting with a space gets no prefix space: the verification holds
            j = next((k for k in range(j, max(j - SPACE_START_TRIES, 0), -1) if text[entry.cut_chars[k]] == " "), j)
        splice.entry = entry
        splice.start, splice.start_token = entry.cut_chars[j], entry.cut_tokens[j]
        splice.cut, splice.cut_token = entry.cut_chars[i], entry.cut_tokens[i]
        return splice

    def tokenize(self, splice: Splice, add_special_tokens: bool = True,
                 on_chars: Callable[[int], None] = lambda _n: None) -> list[int]:
        """The text's ids, exactly as ``tokenizer.encode(text, add_special_tokens=...)``, a new list;
        the text is kept. Runs the tokenizer (releasing the GIL for all but short texts), so meant
        for a pool thread."""
        if not self.enabled:
            on_chars(len(splice.text))
            return _encode(self.tokenizer, splice.text, add_special_tokens).ids
        head = self._head if add_special_tokens else []
        tail = self._tail if add_special_tokens else []
        text, entry = splice.text, splice.entry
        if entry is not None and splice.start == len(text):
            self._count(hits=1, saved_chars=len(text))
            return [*head, *entry.ids, *tail]
        if entry is not None:
            ids = self._spliced(splice, entry, head, tail, on_chars)
            if ids is not None:
                return ids
            self._count(refused=1)
        else:
            self._count(misses=1)
        on_chars(len(text))
        enc = _encode(self._core, text, False)
        core = enc.ids
        if len(text) >= MIN_CACHED_CHARS:
            chars, tokens = _cuts(enc, len(core), 0)
            self._keep(TokenizedText(text, core, [0, *chars], [0, *tokens], splice.keys or chunk_keys(text)))
        return [*head, *core, *tail] if head or tail or len(text) >= MIN_CACHED_CHARS else core

    def _spliced(self, splice: Splice, entry: TokenizedText, head: list[int], tail: list[int],
                 on_chars: Callable[[int], None]) -> list[int] | None:
        """The ids of ``splice.text`` from ``entry``'s up to the cut and the rest tokenized; None when
        the verification refuses."""
        rest = splice.text[splice.start:]
        on_chars(len(rest))
        enc = _encode(self._core, rest, False)
        tids = enc.ids
        overlap = splice.cut_token - splice.start_token
        if not self.verify(enc, tids, entry, splice, overlap):
            return None
        self._count(hits=1, saved_chars=splice.start)
        core = entry.ids[:splice.cut_token]  # NOTE: one copy of the cached ids; extending it is cheap
        core += tids[overlap:]
        if len(splice.text) - splice.cut < STORE_NEW_CHARS:
            # NOTE: little of its own: re-tokenizing it with the next turn costs less than keeping a copy.
            if head or tail:
                core[0:0] = head
                core += tail
            return core
        ids = [*head, *core, *tail] if head or tail else None
        keep = bisect_right(entry.cut_chars, splice.cut)
        chars, tokens = _cuts(enc, len(tids), overlap)
        self._keep(TokenizedText(splice.text, core, entry.cut_chars[:keep] + [c + splice.start for c in chars],
                                 entry.cut_tokens[:keep] + [t + splice.start_token for t in tokens], splice.keys))
        return ids if ids is not None else list(core)

    def _count(self, **more: int) -> None:
        with self._lock:
            for name, n in more.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    @staticmethod
    def verify(enc: Any, tids: list[int], entry: TokenizedText, splice: Splice, overlap: int) -> bool:
        """The tail, tokenized from the cut ``start``, re-derives the cached tokens up to the cut
        ``cut`` and has a pre-token boundary exactly there (module docstring, point 2)."""
        if overlap <= 0 or len(tids) <= overlap:
            return False
        if tids[:overlap] != entry.ids[splice.start_token:splice.cut_token]:
            return False
        if enc.token_to_word(overlap) == enc.token_to_word(overlap - 1):
            return False
        return enc.token_to_chars(overlap)[0] == splice.cut - splice.start

    def _keep(self, entry: TokenizedText) -> None:
        entry.nbytes = (sys.getsizeof(entry.text) + BYTES_PER_HELD_TOKEN * len(entry.ids)
                        + 16 * len(entry.cut_chars) + 64 * len(entry.keys))
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            self._lru[id(entry)] = entry
            for key in entry.keys:
                self._index[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._lru.popitem(last=False)
                self._bytes -= old.nbytes
                for key in old.keys:
                    if self._index.get(key) is old:
                        del self._index[key]
            self.stats.entries, self.stats.bytes = len(self._lru), self._bytes

    def encode(self, text: str, add_special_tokens: bool = True,
               on_chars: Callable[[int], None] = lambda _n: None) -> list[int]:
        """:meth:`lookup` then :meth:`tokenize`, in one call."""
        return self.tokenize(self.lookup(text), add_special_tokens, on_chars)


def chunk_keys(text: str) -> list[int]:
    """The chained hashes of ``text``'s whole ``CHUNK_CHARS`` chunks: key k names ``text[:(k+1)*CHUNK_CHARS]``."""
    keys, h = [], 0
    for k in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        h = hash((h, text[k:k + CHUNK_CHARS]))
        keys.append(h)
    return keys


def common_prefix(a: str, b: str, hint: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``; ``hint`` is where the chunk hashes say they
    agree up to (checked: a hash collision gives 0)."""
    hint = min(hint, len(a), len(b))
    if a[:hint] != b[:hint]:
        return 0
    lo, hi = hint, min(len(a), len(b))
    while lo + CHUNK_CHARS <= hi and a[lo:lo + CHUNK_CHARS] == b[lo:lo + CHUNK_CHARS]:
        lo += CHUNK_CHARS
    top = min(hi, lo + CHUNK_CHARS)
    while lo < top:  # NOTE: a[:lo] == b[:lo]; the answer is in [lo, top]
        mid = (lo + top + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            top = mid - 1
    return lo


_SPACE_THEN_WORD = re.compile(r"\s\S")


def last_space_before_word(text: str, end: int) -> int:
    """The offset of the last whitespace character followed by a non-whitespace one, both before ``end``
    (-1 if none in the last ``4 * CHUNK_CHARS`` characters)."""
    for span in (256, 4 * CHUNK_CHARS):
        found = -1
        for m in _SPACE_THEN_WORD.finditer(text, max(0, end - span), end):
            found = m.start()
        if found >= 0 or span >= end:
            return found
    return -1


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> Any:
    # NOTE: encode_batch releases the GIL while it works, encode holds it throughout (a long text
    # would hold the event loop); for a short one encode saves the hand-over to the tokenizer's threads.
    if len(text) <= HOLD_GIL_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def _last_cut(entry: TokenizedText, limit: int, text: str, ascii_only: bool) -> int:
    """The index of the last cut at or before ``limit`` (before an ASCII character with ``ascii_only``), or -1."""
    i = bisect_right(entry.cut_chars, limit) - 1
    while ascii_only and i > 0 and not text[entry.cut_chars[i]].isascii():
        i -= 1
    return i


def _cuts(enc: Any, n: int, first: int) -> tuple[list[int], list[int]]:
    """Pre-token boundaries of ``enc`` about every ``CHECKPOINT_TOKENS`` tokens after token ``first``:
    (char offsets, token indices)."""
    word, chars = enc.token_to_word, enc.token_to_chars
    out_chars, out_tokens = [], []
    i = first + CHECKPOINT_TOKENS
    while i < n:
        w = word(i - 1)
        while i < n and word(i) == w:
            i += 1
        if i >= n:
            break
        out_chars.append(chars(i)[0])
        out_tokens.append(i)
        i += CHECKPOINT_TOKENS
    return out_chars, out_tokens

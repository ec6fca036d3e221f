"""Synthetic request sets for `kvmesh bench serve` (vLLM `bench serve` conventions) and arrivals.

Every generator is deterministic for a seed and returns :class:`BenchRequest` token-id prompts,
so no tokenizer is involved and prompt lengths are exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class BenchRequest:
    """One request to send."""

    prompt_token_ids: Sequence[int]
    """A list, or an int32 numpy array (trace replay)."""
    output_len: int
    """max_tokens (sent with ignore_eos when asked, so exactly this many come back)."""
    arrival_s: float | None = None
    """Send time relative to the start (trace replay); None = from the arrival process."""


@dataclass(slots=True, frozen=True)
class TokenRange:
    """Token ids a synthetic prompt draws from, [low, high): keeps clear of BOS/EOS at the bottom."""

    low: int = 2
    high: int = 660

    @classmethod
    def for_vocab(cls, vocab_size: int) -> TokenRange:
        """[2, vocab) for small vocabularies; real ones also leave their top 1024 ids (special tokens)."""
        return cls(2, vocab_size - 1024 if vocab_size > 4096 else vocab_size)


def _tokens(rng: np.random.Generator, n: int, tr: TokenRange) -> list[int]:
    return rng.integers(tr.low, tr.high, size=n).tolist()


def random_dataset(num_prompts: int, input_len: int, output_len: int, prefix_len: int = 0, seed: int = 0,
                   tokens: TokenRange | None = None) -> list[BenchRequest]:
    """vLLM's `random`: ``prefix_len`` tokens shared by every prompt, then ``input_len`` random ones."""
    tr = tokens or TokenRange()
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, prefix_len, tr)
    return [BenchRequest(prefix + _tokens(rng, input_len, tr), output_len) for _ in range(num_prompts)]


def prefix_repetition_dataset(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              output_len: int, seed: int = 0, tokens: TokenRange | None = None
                              ) -> list[BenchRequest]:
    """vLLM's `prefix_repetition`: ``num_prefixes`` shared prefixes, each prompt one of them (in turn,
    then shuffled) plus a unique suffix."""
    tr = tokens or TokenRange()
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_len, tr) for _ in range(num_prefixes)]
    out = [BenchRequest(prefixes[i % num_prefixes] + _tokens(rng, suffix_len, tr), output_len)
           for i in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return [out[i] for i in order]


def multi_turn_dataset(num_prompts: int, turns: int, system_len: int, user_len: int, output_len: int,
                       seed: int = 0, tokens: TokenRange | None = None) -> list[BenchRequest]:
    """Conversations of ``turns`` turns; turn k's prompt is turn k-1's prompt, an assistant reply of
    ``output_len`` synthetic tokens and a new user message. Conversations interleave: request i is
    turn ``i // n_conv`` of conversation ``i % n_conv``, so a turn is sent after its predecessor.

    NOTE: the reply in the history is synthetic, not what the server generated: the prefix shared
    between turns is exactly the previous prompt, as with a client that re-sends its own history.
    """
    tr = tokens or TokenRange()
    rng = np.random.default_rng(seed)
    n_conv = max(1, -(-num_prompts // turns))
    histories = [_tokens(rng, system_len, tr) for _ in range(n_conv)]
    out: list[BenchRequest] = []
    for i in range(num_prompts):
        c = i % n_conv
        if i >= n_conv:
            histories[c] = histories[c] + _tokens(rng, output_len, tr)
        histories[c] = histories[c] + _tokens(rng, user_len, tr)
        out.append(BenchRequest(list(histories[c]), output_len))
    return out


def poisson_arrivals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` requests: gamma-distributed gaps of mean 1/rate.

    ``burstiness`` is the gamma shape, as in vLLM: 1 = Poisson, < 1 burstier, > 1 more regular.
    ``request_rate`` inf sends everything at t=0.
    """
    if request_rate == float("inf"):
        return [0.0] * n
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    # NOTE: the first request goes at t=0, as vLLM's generator yields before its first sleep.
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def iter_with_arrivals(requests: list[BenchRequest], arrivals: list[float]) -> Iterator[BenchRequest]:
    for r, t in zip(requests, arrivals, strict=True):
        yield BenchRequest(r.prompt_token_ids, r.output_len, t if r.arrival_s is None else r.arrival_s)

"""What the simulated mesh serves: Mooncake traces and generators, with prompts as segments.

A request's prompt is a sequence of *segments* ``(segment id, tokens)``; equal ids are equal
tokens, so equal leading segments are a shareable prefix. A Mooncake trace line is its blocks
(kvmesh/replay/trace.py, the reader the live bench uses too) as segments of 512 tokens, the last one
cut to ``input_length``. Segment ``s``'s tokens are
the SHAKE-128 stream of ``(seed, s)`` mapped to [2, 256) (the live bench draws other token values
for the same ids; only which blocks are equal matters to routing).

Block hashes are what the index, the router and the engines compare, so each prompt's chain is
computed once per workload and block spec (:meth:`Workload.chains`) and reused by every run of a
sweep. Chains are memoised per segment boundary: a segment's full blocks depend only on the chain
before it and its own tokens, so a prefix shared by many prompts is hashed once. Every segment but
a prompt's last must therefore be a multiple of the block size (the generators round to it; 512 is
a multiple of every power-of-two block size up to 512).

Generators (``--workload NAME``), each deterministic for a seed; at ``--rate 1`` they offer the
``base_rate`` given here (requests/s):

- ``shared-prefix``: llm-d's prefix benchmark shape: groups of prompts behind one 8k-token prefix
  (the group's system prompt / document) plus a private question; groups interleave.
- ``multi-turn``: chat sessions with think time; turn k's prompt is the session's system prompt
  plus every earlier user message and reply plus the new message, so the context grows.
- ``hot-prompt``: one system prompt shared by every user, plus a private message (the hot spot of
  Dynamo issue #737: a pure prefix router sends everyone to one worker).
- ``no-reuse``: nothing shared (the control: a cache-aware router should lose nothing).
- ``code-generation`` and ``reasoning``: two workloads of kubernetes-sigs/inference-perf's workload
  catalog (``workload-catalog/``), their length distributions as its configs give them (the functions
  below cite the files and commits): coding-agent conversations behind 18k-123k-token system prompts,
  and small reasoning prompts behind one 250-token prompt with 8k-token answers.
- ``multi-adapter``: many LoRA adapters (Zipf over 64), each with its own system prompts (issue 52;
  docs/adapters.md): the prefix cached under the adapter against the adapter's residency.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvmesh.contract.block_hash import BlockHasher, adapter_hasher
from kvmesh.replay.trace import TRACE_BLOCK_TOKENS, load_trace

TOKEN_LOW, TOKEN_HIGH = 2, 256
"""Synthetic token ids: above BOS/EOS of the demo vocabulary, below 256 so a prompt list holds
CPython's shared small ints (a 3,000-request replay would otherwise allocate ~36M int objects)."""


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival_s: float
    """At ``--rate 1``; a run at rate r sends it at ``arrival_s / r``."""
    prompt_len: int
    output_len: int
    segments: tuple[tuple[int, int], ...]
    """(segment id, tokens) in prompt order; their lengths sum to ``prompt_len``."""
    adapter: str = ""
    """The LoRA adapter it runs under ("" = the base model): its blocks are keyed by it."""


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    seed: int = 0
    description: str = ""
    _chains: dict[tuple[str, int, str], list[list[bytes]]] = field(default_factory=dict, repr=False)
    _segment_tokens: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters its requests run under, sorted (none: a base-model workload)."""
        return sorted({r.adapter for r in self.requests if r.adapter})

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def first(self, n: int | None) -> Workload:
        """The first ``n`` requests (all when None)."""
        if n is None or n >= len(self.requests):
            return self
        return Workload(self.name, self.requests[:n], self.seed, self.description)

    # -- tokens and chains ----------------------------------------------------------------------
    def segment(self, seg_id: int, n: int) -> np.ndarray:
        """The first ``n`` tokens of a segment (uint8).

        NOTE: SHAKE's output is a stream: the first ``n`` bytes of a longer digest equal a digest of
        ``n``, so a segment's tokens never depend on how much of it is asked for.
        """
        arr = self._segment_tokens.get(seg_id)
        if arr is None or len(arr) < n:
            # NOTE: SHAKE-128 as the stream (a numpy Generator costs ~50 us to seed, per segment).
            raw = hashlib.shake_128(f"kvmesh-sim:{self.seed}:{seg_id}".encode()).digest(n)
            arr = np.frombuffer(raw, dtype=np.uint8) % (TOKEN_HIGH - TOKEN_LOW) + TOKEN_LOW
            arr = arr.astype(np.uint8)
            if seg_id >= 0:  # NOTE: private segments are used once; keeping them would only cost memory
                self._segment_tokens[seg_id] = arr
        return arr[:n]

    def prompt(self, r: SimRequest) -> list[int]:
        """The request's token ids."""
        return np.concatenate([self.segment(s, n) for s, n in r.segments]).tolist()

    def chains(self, hasher: BlockHasher) -> list[list[bytes]]:
        """Every request's block hashes under ``hasher`` (computed once, then cached)."""
        key = (hasher.model_id, hasher.block_size, hasher.algorithm)
        got = self._chains.get(key)
        if got is None:
            got = self._chains[key] = self._compute_chains(hasher)
        return got

    def _compute_chains(self, hasher: BlockHasher) -> list[list[bytes]]:
        bs = hasher.block_size
        root = hasher.root()
        # (chain hash before the segment, segment id, adapter) -> hashes of the segment's full blocks
        memo: dict[tuple[bytes, int, str], list[bytes]] = {}
        out: list[list[bytes]] = []
        hashers = {"": hasher}
        for r in self.requests:
            chain: list[bytes] = []
            parent = root
            # NOTE: under an adapter its name is an extra key of every block (the engine's and the router's
            # keying, adapter_hasher): another chain from the first block on, so the memo's parents differ.
            h = hashers.get(r.adapter)
            if h is None:
                h = hashers[r.adapter] = adapter_hasher(hasher, r.adapter)
            for i, (seg, n) in enumerate(r.segments):
                last = i == len(r.segments) - 1
                if not last and n % bs:
                    raise ValueError(f"request {r.index}: segment {seg} has {n} tokens, not a multiple of "
                                     f"block size {bs} (only a prompt's last segment may end mid-block)")
                full = n // bs
                if full == 0:
                    continue
                key = (parent, seg, r.adapter)
                hashes = memo.get(key)
                if hashes is None or len(hashes) < full:
                    # NOTE: a segment id is one token stream, whatever length a prompt cuts it to,
                    # so the first k block hashes never change: keep the longest computed.
                    hashes = h.hash_prompt(self.segment(seg, full * bs).tolist(), parent=parent)
                    if seg >= 0:
                        memo[key] = hashes
                chain.extend(hashes[:full])
                parent = chain[-1]
                if full * bs != n:
                    break  # a partial block ends the chain
            out.append(chain)
        return out


# -- Mooncake traces -----------------------------------------------------------------------------
def trace_workload(path: str | Path, max_requests: int | None = None, seed: int = 0, skip: int = 0) -> Workload:
    """A Mooncake JSONL trace (kvmesh/replay/trace.py reads it) as segments: each of its blocks a
    segment of 512 tokens, the last cut to ``input_length``.

    ``skip`` starts at the trace's request ``skip`` (a later segment); times count from its first.
    """
    reqs: list[SimRequest] = []
    t0: float | None = None
    for i, rec in enumerate(load_trace(path, max_requests, skip)):
        ts = rec.timestamp_ms / 1000.0
        t0 = ts if t0 is None else t0
        ids = rec.block_ids(i)
        segs = [(h, TRACE_BLOCK_TOKENS) for h in ids]
        if segs:
            segs[-1] = (segs[-1][0], rec.input_length - TRACE_BLOCK_TOKENS * (len(ids) - 1))
        reqs.append(SimRequest(i, ts - t0, rec.input_length, max(1, rec.output_length), tuple(segs)))
    segment = f", requests {skip}-{skip + len(reqs) - 1}" if skip else ""
    return Workload(Path(path).stem, reqs, seed, f"Mooncake trace {path}{segment}")


# -- generators ----------------------------------------------------------------------------------
def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _poisson_times(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n)) - 0.0


def shared_prefix(num_requests: int = 3000, groups: int = 150, prefix_len: int = 8192, question_len: int = 1024,
                  output_len: int = 512, base_rate: float = 10.0, seed: int = 0) -> Workload:
    """Groups of prompts behind one ``prefix_len`` prefix (llm-d's sizing); requests pick a group at
    random, so each group's prompts arrive spread over the run."""
    rng = np.random.default_rng([seed, 1])
    t = _poisson_times(rng, num_requests, base_rate)
    group = rng.integers(0, groups, num_requests)
    reqs = []
    for i in range(num_requests):
        segs = ((1_000_000 + int(group[i]), prefix_len), (-(i + 1), question_len))
        reqs.append(SimRequest(i, float(t[i]), prefix_len + question_len, output_len, segs))
    return Workload("shared-prefix", reqs, seed,
                    f"{groups} groups x 1 prefix of {prefix_len} tokens + {question_len}-token questions, "
                    f"{output_len} output tokens, Poisson {base_rate:g} req/s at rate 1")


def multi_turn(num_requests: int = 3000, system_len: int = 2048, user_len: int = 512, reply_len: int = 512,
               turns: int = 6, think_s: float = 10.0, base_rate: float = 12.0, seed: int = 0) -> Workload:
    """Chat sessions: sessions start as a Poisson process; turn k+1 follows turn k after the reply's
    (unknown) latency plus ``think_s`` (exponential), modelled at the arrival times (open loop).

    Turn k's prompt: system prompt + (user message, reply) of every earlier turn + the new message.
    The replies are segments the engine never generated (a simulated worker's tokens differ), so a
    turn hits at most the previous turn's prompt, as with re-tokenised replies.
    """
    rng = np.random.default_rng([seed, 2])
    system_len, user_len, reply_len = (_round_up(x, 64) for x in (system_len, user_len, reply_len))
    sessions = -(-num_requests // turns)
    starts = _poisson_times(rng, sessions, base_rate / turns)
    pending: list[tuple[float, int, int]] = []
    for s in range(sessions):
        t = float(starts[s])
        for k in range(turns):
            pending.append((t, s, k))
            t += float(rng.exponential(think_s)) + 1.0
    pending.sort()
    reqs = []
    for t, s, k in pending[:num_requests]:
        segs = [(2_000_000 + s * 100_000, system_len)]
        for j in range(k):
            segs += [(2_000_000 + s * 100_000 + 2 * j + 1, user_len), (2_000_000 + s * 100_000 + 2 * j + 2, reply_len)]
        segs.append((2_000_000 + s * 100_000 + 2 * k + 1, user_len))
        reqs.append(SimRequest(len(reqs), t, sum(n for _, n in segs), reply_len, tuple(segs)))
    return Workload("multi-turn", reqs, seed,
                    f"sessions of {turns} turns, system {system_len} + {user_len} per message + {reply_len} per reply, "
                    f"think time {think_s:g} s, {base_rate:g} req/s at rate 1")


def hot_prompt(num_requests: int = 3000, system_len: int = 4096, user_len: int = 1024, output_len: int = 512,
               base_rate: float = 12.0, seed: int = 0) -> Workload:
    """One system prompt for every user plus a private message."""
    rng = np.random.default_rng([seed, 3])
    t = _poisson_times(rng, num_requests, base_rate)
    reqs = [SimRequest(i, float(t[i]), system_len + user_len, output_len, ((3_000_000, system_len), (-(i + 1), user_len)))
            for i in range(num_requests)]
    return Workload("hot-prompt", reqs, seed,
                    f"one {system_len}-token system prompt + {user_len}-token messages, {output_len} output tokens, "
                    f"Poisson {base_rate:g} req/s at rate 1")


def no_reuse(num_requests: int = 3000, input_len: int = 4096, output_len: int = 512, base_rate: float = 6.0,
             seed: int = 0) -> Workload:
    """Private prompts only: no policy can hit the cache."""
    rng = np.random.default_rng([seed, 4])
    t = _poisson_times(rng, num_requests, base_rate)
    lens = rng.integers(input_len // 2, input_len * 3 // 2, num_requests)
    reqs = [SimRequest(i, float(t[i]), int(lens[i]), output_len, ((-(i + 1), int(lens[i])),)) for i in range(num_requests)]
    return Workload("no-reuse", reqs, seed, f"private prompts of {input_len // 2}-{input_len * 3 // 2} tokens, "
                                            f"{output_len} output tokens, Poisson {base_rate:g} req/s at rate 1")


def long_beside_chat(num_requests: int = 3000, chat_len: int = 256, long_len: int = 8192, long_share: float = 0.1,
                     chat_output: int = 256, long_output: int = 64, base_rate: float = 12.0, seed: int = 0) -> Workload:
    """Short chats, and long documents arriving beside them (prefill/decode disaggregation's case: a long
    prefill stalls every chat decoding with it): private prompts, ``long_share`` of them ``long_len`` tokens."""
    rng = np.random.default_rng([seed, 5])
    t = _poisson_times(rng, num_requests, base_rate)
    long = rng.random(num_requests) < long_share
    reqs = []
    for i in range(num_requests):
        n, out = (long_len, long_output) if long[i] else (chat_len, chat_output)
        reqs.append(SimRequest(i, float(t[i]), n, out, ((-(i + 1), n),)))
    return Workload("long-beside-chat", reqs, seed,
                    f"{chat_len}-token chats ({chat_output} out) and {long_share:.0%} {long_len}-token documents "
                    f"({long_output} out), private prompts, Poisson {base_rate:g} req/s at rate 1")


# -- inference-perf's workload catalog ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LengthDist:
    """One length distribution as inference-perf's configs write it (type, min, max, mean, std_dev).

    Drawn as its ``generate_distribution`` does: ``lognormal`` is shifted so ``lo`` maps to 0 and has
    the given mean and std_dev above it; ``normal`` and ``lognormal`` are clipped to [lo, hi]; integers
    are rounded.
    """

    kind: str
    lo: float
    hi: float
    mean: float
    std: float = 0.0

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.mean)
        if self.kind == "uniform":
            x = rng.uniform(self.lo, self.hi, n)
        elif self.kind == "normal":
            x = rng.normal(self.mean, self.std, n)
        elif self.kind == "lognormal":
            above = max(self.mean - self.lo, 1.0)
            var = math.log(1.0 + (self.std / above) ** 2)
            x = self.lo + rng.lognormal(math.log(above) - var / 2, math.sqrt(var), n)
        else:
            raise ValueError(f"unknown distribution {self.kind!r}")
        return np.clip(x, self.lo, self.hi)

    def draw_int(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.round(self.draw(rng, n)).astype(np.int64)


CODE_SHARED_SEGMENT = 40_000_000
"""Code generation's segment ids: the shared system prompt; + blueprint: its own system prompt; message
(blueprint b, turn k) and reply (conversation c, turn k) at the bases below + 1,000 b + k, 1,000 c + k."""
CODE_SYSTEM_BASE = 41_000_000
CODE_MESSAGE_BASE = 42_000_000
CODE_REPLY_BASE = 50_000_000
REASONING_SHARED_SEGMENT = 60_000_000
ANSWER_MARGIN = 200
"""Tokens inference-perf keeps free below max_model_len when it trims a conversation's history."""


def code_generation(num_requests: int = 3000, conversations: int = 20, shared_system_len: int = 3000,
                    system_len: LengthDist = LengthDist("uniform", 15_000, 120_000, 55_000, 25_000),
                    turns: LengthDist = LengthDist("normal", 2, 20, 6, 3.5),
                    message_len: LengthDist = LengthDist("lognormal", 100, 10_000, 1500, 1200),
                    reply_len: LengthDist = LengthDist("lognormal", 50, 4000, 800, 600),
                    tool_s: LengthDist = LengthDist("lognormal", 15, 120, 45, 25),
                    decode_tps: float = 50.0, max_model_len: int = 131_072, base_rate: float = 0.4,
                    seed: int = 0) -> Workload:
    """inference-perf's ``code-generation`` (kubernetes-sigs/inference-perf, commit e2c6268,
    workload-catalog/code-generation/inference-perf.yaml, its ``conversation_replay`` data): 20
    conversation blueprints, each a system prompt of a 3,000-token part shared by all and its own
    15k-120k part, 2-20 turns of a user message and a reply, a tool call between turns.

    As that harness does, a blueprint is replayed again and again (its slots restart a finished
    conversation from turn 0 with the same system prompt and messages; the replies differ); conversation
    ``c`` replays blueprint ``c mod conversations``. Turn k's prompt is the system prompt, every earlier
    (message, reply) and message k; when it and its reply would not fit ``max_model_len`` (the simulated
    engine's, 131,072) less 200 tokens, the oldest turns are dropped, as inference-perf trims (after
    commit 5fb5e1a). Open loop: conversations start as a Poisson process; turn k+1 comes after turn k by
    its reply at ``decode_tps`` plus the tool call. Lengths are rounded up to 64 tokens (a segment but a
    prompt's last must fill whole blocks); messages are cut so one fits beside the system prompt.
    """
    if conversations > 1000:
        raise ValueError("at most 1,000 conversation blueprints (segment ids hold 1,000 per base)")
    rng = np.random.default_rng([seed, 6])
    shared = _round_up(shared_system_len, 64)
    own = [_round_up(int(n), 64) for n in system_len.draw_int(rng, conversations)]
    n_turns = turns.draw_int(rng, conversations)
    blueprints = []
    for b in range(conversations):
        k = int(n_turns[b])
        replies = [_round_up(int(n), 64) for n in reply_len.draw_int(rng, k)]
        room = max_model_len - ANSWER_MARGIN - shared - own[b]
        msgs = [min(_round_up(int(n), 64), (room - out) // 64 * 64) for n, out in zip(message_len.draw_int(rng, k), replies, strict=True)]
        blueprints.append((msgs, replies, tool_s.draw(rng, k)))
    mean_turns = float(np.mean(n_turns))
    sessions = -(-num_requests // 2)  # NOTE: every blueprint has >= 2 turns, so this many always suffice
    starts = _poisson_times(rng, sessions, base_rate / mean_turns)
    pending: list[tuple[float, int, int]] = []
    for c in range(sessions):
        msgs, replies, tool = blueprints[c % conversations]
        t = float(starts[c])
        for k in range(len(msgs)):
            pending.append((t, c, k))
            t += replies[k] / decode_tps + float(tool[k])
    pending.sort()
    reqs = []
    for t, c, k in pending[:num_requests]:
        b = c % conversations
        msgs, replies, _ = blueprints[b]
        system = [(CODE_SHARED_SEGMENT, shared), (CODE_SYSTEM_BASE + b, own[b])]
        first = 0
        while sum(msgs[first:k + 1]) + sum(replies[first:k]) + shared + own[b] + replies[k] > max_model_len - ANSWER_MARGIN:
            first += 1
        segs = list(system)
        for j in range(first, k):
            segs += [(CODE_MESSAGE_BASE + 1000 * b + j, msgs[j]), (CODE_REPLY_BASE + 1000 * c + j, replies[j])]
        segs.append((CODE_MESSAGE_BASE + 1000 * b + k, msgs[k]))
        reqs.append(SimRequest(len(reqs), t, sum(n for _, n in segs), replies[k], tuple(segs)))
    return Workload("code-generation", reqs, seed,
                    f"{conversations} blueprints replayed: system {shared} shared + {min(own)}-{max(own)} own, "
                    f"{int(n_turns.min())}-{int(n_turns.max())} turns, messages ~{message_len.mean:g}, replies "
                    f"~{reply_len.mean:g}, tool calls ~{tool_s.mean:g} s, {base_rate:g} req/s at rate 1")


def reasoning(num_requests: int = 3000, shared_len: int = 250,
              question_len: LengthDist = LengthDist("lognormal", 100, 5000, 1000, 800),
              output_len: LengthDist = LengthDist("lognormal", 500, 32_000, 8000, 6500),
              base_rate: float = 1.0, seed: int = 0) -> Workload:
    """inference-perf's ``reasoning`` (kubernetes-sigs/inference-perf, commit 5cbfb21,
    workload-catalog/reasoning/inference-perf.yaml): one turn, a 250-token prompt every request shares
    (rounded up to 256, a whole number of blocks) plus a question, long answers (mean 8,000 tokens).

    Questions are private: the harness replays its 10 conversations' prompts, but the workload is new
    problems (AIME, its README says). Poisson arrivals.
    """
    rng = np.random.default_rng([seed, 7])
    shared = _round_up(shared_len, 64)
    t = _poisson_times(rng, num_requests, base_rate)
    q = question_len.draw_int(rng, num_requests)
    out = output_len.draw_int(rng, num_requests)
    reqs = [SimRequest(i, float(t[i]), shared + int(q[i]), int(out[i]),
                       ((REASONING_SHARED_SEGMENT, shared), (-(i + 1), int(q[i]))))
            for i in range(num_requests)]
    return Workload("reasoning", reqs, seed,
                    f"one {shared}-token prompt + questions ~{question_len.mean:g} tokens, answers "
                    f"~{output_len.mean:g} tokens, Poisson {base_rate:g} req/s at rate 1")


ADAPTER_SYSTEM_BASE = 70_000_000
"""Multi-adapter's segment ids: adapter a's system prompt k is ADAPTER_SYSTEM_BASE + 100 a + k."""


def multi_adapter(num_requests: int = 3000, adapters: int = 64, zipf_s: float = 1.1, prompts_per_adapter: int = 2,
                  system_len: tuple[int, int] = (1024, 2048), user_len: tuple[int, int] = (200, 500),
                  output_len: tuple[int, int] = (100, 300), base_rate: float = 20.0, seed: int = 0) -> Workload:
    """Many LoRA adapters on one base model (issue 52): a request's adapter is drawn Zipf(``zipf_s``) over
    ``adapters`` (rank 1 the most used); each adapter has ``prompts_per_adapter`` system prompts of its own
    (uniform in ``system_len``, rounded to 64 tokens), one of which, uniformly, starts its prompt, then a
    private user message (uniform in ``user_len``); outputs uniform in ``output_len``. Poisson arrivals.
    Adapters are named ``adapter-00`` ... (by rank)."""
    if prompts_per_adapter > 100:
        raise ValueError("at most 100 system prompts per adapter (segment ids hold 100 per adapter)")
    rng = np.random.default_rng([seed, 8])
    t = _poisson_times(rng, num_requests, base_rate)
    weights = 1.0 / np.arange(1, adapters + 1) ** zipf_s
    which = rng.choice(adapters, num_requests, p=weights / weights.sum())
    systems = rng.integers(system_len[0], system_len[1] + 1, (adapters, prompts_per_adapter))
    prompt = rng.integers(0, prompts_per_adapter, num_requests)
    users = rng.integers(user_len[0], user_len[1] + 1, num_requests)
    outs = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    reqs = []
    for i in range(num_requests):
        a, k = int(which[i]), int(prompt[i])
        segs = ((ADAPTER_SYSTEM_BASE + 100 * a + k, _round_up(int(systems[a, k]), 64)), (-(i + 1), int(users[i])))
        reqs.append(SimRequest(i, float(t[i]), sum(n for _, n in segs), int(outs[i]), segs, f"adapter-{a:02d}"))
    return Workload("multi-adapter", reqs, seed,
                    f"{adapters} LoRA adapters, Zipf s={zipf_s:g}; {prompts_per_adapter} system prompts of "
                    f"{system_len[0]}-{system_len[1]} tokens per adapter + {user_len[0]}-{user_len[1]}-token messages, "
                    f"{output_len[0]}-{output_len[1]} output tokens, Poisson {base_rate:g} req/s at rate 1")


GENERATORS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "hot-prompt": hot_prompt, "no-reuse": no_reuse,
              "long-beside-chat": long_beside_chat, "code-generation": code_generation, "reasoning": reasoning,
              "multi-adapter": multi_adapter}


def make_workload(name: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    """A generator's workload by name (``--workload``); ``num_requests`` None = its default size."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(GENERATORS)}") from None
    return gen(seed=seed) if num_requests is None else gen(num_requests=num_requests, seed=seed)

"""router/text/prefix_tokens.py: a text spliced onto a cached prefix gets exactly the ids of one whole
``encode``, on real tokenizers (the demo model's, a bigger byte-level BPE, tokenizers that are not
prefix-stable at their start), over prefixes that end mid-word, mid-character, mid-whitespace run,
on chat templates, with and without special tokens; the verification and the whitespace rule are
what keep it exact (the tests below fail without them); the cache is bounded; the pool runs the
cheapest deadline first."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvmesh.make_model import CORPUS, SPLIT_REGEX, ModelSpec, make_model, train_tokenizer
from kvmesh.router.models import ModelFiles
from kvmesh.router.text import prefix_tokens
from kvmesh.router.text.prefix_tokens import CHUNK_CHARS, PrefixTokenCache, unsupported_reason
from kvmesh.router.text.prompt import MIN_TOKENIZER_THREADS, PromptLimits, PromptTokenizer
from kvmesh.router.text.tokenizer_pool import TokenizerPool, usable_cores

WORDS = CORPUS.read_text(encoding="utf-8").split()
SEPARATORS = [" ", " ", " ", " ", "\n", "  ", "\n\n", "\t", " \n ", ", ", ". ", "\n" + " " * 40, " " * 300, "\n\n\n   ",
              "\n    \n"]
ODD = ["é", "漢字", "🙂", "naïve", "Straße", "e\u0301", "<s>", "</s>", "123456", "...", "'s", "—"]


def words(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS) if rng.random() < 0.9 else rng.choice(ODD)
        piece = w + rng.choice(SEPARATORS)
        out.append(piece)
        size += len(piece)
    return "".join(out)


def train_bpe(vocab: int, pre: object, normalizer: object = None, model: object = None) -> Tokenizer:
    """A BPE trained here on the demo corpus and generated text, over the given pre-tokenizer."""
    tok = Tokenizer(model or models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(7)
    lines = CORPUS.read_text(encoding="utf-8").splitlines() + [words(rng, 400) for _ in range(400)]
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def byte_level(add_prefix_space: bool = False) -> object:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])


@pytest.fixture(scope="module")
def tokenizers_by_name() -> dict[str, Tokenizer]:
    from tokenizers import processors

    big = train_bpe(4096, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    big.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    nfc = train_bpe(2048, byte_level(), normalizer=normalizers.NFC())
    return {"demo": train_tokenizer(), "gpt2-style-4096-bos-eos": big, "nfc": nfc,
            "gpt4-style-2048": train_bpe(2048, byte_level()),
            "prefix-space": train_bpe(2048, pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)),
            "metaspace": train_bpe(2048, pre_tokenizers.Metaspace(prepend_scheme="always"))}


def prompt_pairs(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(cached text, new text) pairs: a shared prefix cut at a random character (mid-word, mid-multibyte
    character, mid-whitespace run), then different endings; some new texts are prefixes of the cached."""
    pairs = []
    for _ in range(n):
        base = words(rng, rng.randrange(3 * CHUNK_CHARS, 12 * CHUNK_CHARS))
        cut = rng.randrange(CHUNK_CHARS, len(base))
        kind = rng.random()
        if kind < 0.15:
            new = base[:cut]  # a prefix of the cached text
        elif kind < 0.3:
            new = base + words(rng, 500)  # the cached text and more (a conversation's next turn)
        else:
            new = base[:cut] + rng.choice(["", " ", "\n", "x", "é"]) + words(rng, rng.randrange(0, 4000))
        pairs.append((base, new))
    return pairs


@pytest.mark.parametrize("name", ["demo", "gpt2-style-4096-bos-eos", "gpt4-style-2048", "nfc", "prefix-space",
                                  "metaspace"])
def test_spliced_ids_are_the_whole_encode(tokenizers_by_name, name):
    tok = tokenizers_by_name[name]
    cache = PrefixTokenCache(tok)
    assert cache.enabled, cache.disabled_reason
    rng = random.Random(name)
    for base, new in prompt_pairs(rng, 60):
        for text in (base, new):
            add = rng.random() < 0.5
            assert cache.encode(text, add) == tok.encode(text, add_special_tokens=add).ids, (name, len(text))
    assert cache.stats.hits >= 40, cache.stats  # the cache was used, not only the whole encode


def test_ids_across_a_multibyte_character_and_a_whitespace_run(tokenizers_by_name):
    tok = tokenizers_by_name["demo"]
    cache = PrefixTokenCache(tok)
    rng = random.Random(3)
    head = words(rng, 6 * CHUNK_CHARS)
    cases = [
        (head + "漢字🙂" * 50, head + "漢字🙂" * 20 + "漢x"),  # diverges inside a run of multibyte characters
        (head + "\n" + " " * 3000 + "word", head + "\n" + " " * 3000 + "\nword"),  # inside a long run of spaces
        (head + "\n" + " " * 3000 + "x", head + "\n" + " " * 2000),  # a prefix ending in the run
        (head + "supercalifragilistic" * 200, head + "supercalifragilistic" * 150 + "s"),  # inside one long word
    ]
    for old, new in cases:
        cache.encode(old)
        assert cache.encode(new) == tok.encode(new).ids


@pytest.mark.parametrize("name", ["prefix-space"])
def test_without_the_verification_a_tokenizer_with_a_prefix_space_gets_wrong_ids(tokenizers_by_name, monkeypatch,
                                                                                  name):
    """GPT-2's ByteLevel(add_prefix_space=True) and Metaspace(prepend_scheme="always") tokenize a text's
    first word as if a space preceded it: a tail tokenized alone differs from the whole text's there.
    The verification refuses those splices."""
    tok = tokenizers_by_name[name]
    rng = random.Random(11)
    pairs = []
    for _ in range(20):  # words apart by newlines and tabs: pre-tokens that do not start with a space
        base = "".join(rng.choice(WORDS) + rng.choice(["\n", "\t", "\n\n"]) for _ in range(2000))
        cut = rng.randrange(CHUNK_CHARS, len(base))
        pairs.append((base, base[:cut] + "x" + base[cut:cut + 3000]))

    def mismatches() -> tuple[int, PrefixTokenCache]:
        cache = PrefixTokenCache(tok)
        wrong = 0
        for base, new in pairs:
            cache.encode(base, False)
            wrong += cache.encode(new, False) != tok.encode(new, add_special_tokens=False).ids
        return wrong, cache

    wrong, cache = mismatches()
    assert wrong == 0 and cache.stats.refused > 0, cache.stats
    monkeypatch.setattr(PrefixTokenCache, "verify", staticmethod(lambda *a: True))
    assert mismatches()[0] > 0  # the planted bug: a splice accepted unverified


def test_the_whitespace_rule_keeps_a_cut_off_a_run_of_spaces_that_a_newline_ends(tokenizers_by_name, monkeypatch):
    r"""``\s*[\r\n]+`` reads a whole run of spaces to see whether a newline ends it: in
    ``"end\n" + 1000 spaces + "x"`` the newline is a pre-token of its own, in ``... + "\nword"`` the
    newline, the spaces and the newline are one. A cut after the first newline, far (in characters)
    from where the two texts differ, is wrong: the rule keeps cuts before a whitespace-then-word pair
    ahead of the difference. (The verification refuses that cut too: the rule alone is checked here,
    the verification switched off; both off, the ids are wrong.)"""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))} | {"ĊĠ": len(alphabet)}
    tok = Tokenizer(models.BPE(vocab, [("Ċ", "Ġ")]))  # a newline merges with the space after it
    tok.pre_tokenizer = byte_level()
    rng = random.Random(5)
    pairs = []
    for _ in range(10):
        head = words(rng, 3 * CHUNK_CHARS) + "end\n"
        pairs.append((head + " " * 1000 + "x", head + " " * 1000 + "\nword"))

    def mismatches() -> int:
        cache = PrefixTokenCache(tok)
        wrong = 0
        for old, new in pairs:
            cache.encode(old)
            wrong += cache.encode(new) != tok.encode(new).ids
        assert cache.stats.hits + cache.stats.refused == len(pairs)
        return wrong

    monkeypatch.setattr(prefix_tokens, "CHECKPOINT_TOKENS", 1)  # every pre-token boundary is a cut
    assert mismatches() == 0
    monkeypatch.setattr(PrefixTokenCache, "verify", staticmethod(lambda *a: True))
    assert mismatches() == 0  # the rule alone
    monkeypatch.setattr(prefix_tokens, "last_space_before_word", lambda text, end: end)
    assert mismatches() > 0  # the planted bug: neither the rule nor the verification


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    spec = ModelSpec(arch="qwen2", layers=1, hidden_size=32, heads=2, kv_heads=1, intermediate_size=64,
                     max_position_embeddings=131072)
    return make_model(tmp_path_factory.mktemp("chat") / "tiny", spec)


def test_a_conversation_and_its_next_turn_are_tokenized_as_whole_texts(chat_model):
    files = ModelFiles.load(str(chat_model))
    prompts = PromptTokenizer(files.tokenizer)
    limits = PromptLimits.resolve(None, None, 131072, 16)
    rng = random.Random(2)
    chat = [{"role": "system", "content": words(rng, 3000)}]

    async def turns() -> None:
        for turn in range(8):
            chat.append({"role": "user" if turn % 2 == 0 else "assistant", "content": words(rng, rng.randrange(5, 3000))})
            for gen in (True, False):
                text = files.chat_template.render(chat, add_generation_prompt=gen)
                ids = await prompts.encode(text, limits, add_special_tokens=False)
                assert ids == files.tokenizer.encode(text, add_special_tokens=False).ids

    asyncio.run(turns())
    assert prompts.cache.stats.hits >= 10, prompts.cache.stats
    prompts.close()


def test_tokenizers_it_cannot_splice_get_no_cache_and_whole_ids():
    base = train_bpe(512, byte_level())
    no_pre = Tokenizer.from_str(base.to_str())
    no_pre.pre_tokenizer = None
    behind = Tokenizer.from_str(base.to_str())
    behind.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?<=\s)\S+|\s+"), behavior="isolated")
    dropout = Tokenizer.from_str(base.to_str().replace('"dropout":null', '"dropout":0.1'))
    truncating = Tokenizer.from_str(base.to_str())
    truncating.enable_truncation(100)
    expected = {no_pre: "no pre-tokenizer", behind: "reads behind", dropout: "dropout", truncating: "truncation"}
    for tok, why in expected.items():
        assert why in (unsupported_reason(tok) or ""), unsupported_reason(tok)
        cache = PrefixTokenCache(tok)
        assert not cache.enabled
        text = words(random.Random(1), 3000)
        if tok is not dropout:
            assert cache.encode(text) == tok.encode(text).ids
    assert unsupported_reason(base) is None
    assert not PrefixTokenCache(base, max_bytes=0).enabled


def test_the_cache_is_bounded_in_bytes_least_recently_used_first_out(tokenizers_by_name):
    tok = tokenizers_by_name["demo"]
    rng = random.Random(9)
    texts = [words(rng, 8 * CHUNK_CHARS) for _ in range(6)]
    one = PrefixTokenCache(tok)
    one.encode(texts[0])
    size = one.stats.bytes
    cache = PrefixTokenCache(tok, max_bytes=int(3.5 * size))
    for t in texts[:3]:
        cache.encode(t)
    cache.encode(texts[0] + "more")  # touches texts[0]; not kept: little of its own
    cache.encode(texts[3])
    assert cache.stats.entries == 3 and cache.stats.bytes <= cache.max_bytes
    kept = {i for i, t in enumerate(texts[:4]) if cache.lookup(t).entry is not None}
    assert kept == {0, 2, 3}  # texts[1] was the least recently used
    assert cache.encode(texts[2]) == tok.encode(texts[2]).ids


def test_the_pool_runs_the_cheapest_deadline_first_on_one_thread_per_core():
    pool = TokenizerPool(1)
    gate, order = threading.Event(), []
    pool.submit_at(0.0, gate.wait)
    futures = [pool.submit_at(key, order.append, key) for key in (3.0, 1.0, 2.0)]
    gate.set()
    for f in futures:
        f.result(timeout=10)
    assert order == [1.0, 2.0, 3.0]
    pool.shutdown()
    prompts = PromptTokenizer(train_tokenizer())
    assert prompts._executor.threads == max(MIN_TOKENIZER_THREADS, usable_cores()) == max(2, len(os.sched_getaffinity(0)))
    assert PromptTokenizer(train_tokenizer(), threads=5)._executor.threads == 5
    prompts.close()


def test_common_prefix_is_exact_whatever_the_hint():
    a = "x" * 5000 + "abc" + "y" * 3000
    for b, expected in ((a, len(a)), (a[:4000], 4000), ("x" * 5000 + "abd", 5002), ("z" + a[1:], 0), ("", 0)):
        for hint in (0, 1024, 4096):
            # NOTE: a hint past the first difference (a hash collision) gives 0: a miss, never a wrong cut
            want = 0 if min(hint, len(a), len(b)) > expected else expected
            assert prefix_tokens.common_prefix(a, b, hint) == want, (len(b), hint)

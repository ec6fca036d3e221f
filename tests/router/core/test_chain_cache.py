"""router/core/chain_cache.py: a chain from a kept prompt's shared blocks equals the whole prompt's chain."""

from __future__ import annotations

import random

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.router.core.chain_cache import ChainCache


@pytest.mark.parametrize("algorithm", ["sha256_128", "xxh3_128"])
def test_every_chain_equals_the_whole_prompts_hashes(algorithm):
    rng = random.Random(4)
    hasher = BlockHasher("m", 16, algorithm)
    cache = ChainCache(min_blocks=4)
    systems = [[rng.randrange(0, 50_000) for _ in range(rng.randrange(64, 400))] for _ in range(3)]
    for i in range(120):
        base = list(systems[i % 3])
        # NOTE: the prompts part at every offset, inside a block and on its edge, and some extend others
        cut = rng.randrange(0, len(base) + 1)
        ids = base[:cut] + [rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 300))]
        salt = "" if i % 7 else "tenant"
        assert cache.chain(hasher, ids, salt) == hasher.hash_prompt(ids, salt), i
    assert cache.reused_blocks > 0  # some prompts shared blocks with one kept (the exact counts: below)


def test_a_prompt_sharing_blocks_is_hashed_from_where_they_part():
    hasher = BlockHasher("m", 4)
    cache = ChainCache(min_blocks=2)
    first = list(range(100))
    cache.chain(hasher, first)
    cache.hashed_blocks = 0
    second = first[:42] + [7] * 20  # 10 blocks shared (40 ids), the 11th differs at id 42
    assert cache.chain(hasher, second) == hasher.hash_prompt(second)
    assert (cache.reused_blocks, cache.hashed_blocks) == (10, 5)


def test_the_salt_the_model_and_the_first_block_keep_chains_apart():
    cache = ChainCache(min_blocks=2)
    ids = list(range(64))
    a, b = BlockHasher("a", 4), BlockHasher("b", 4)
    cache.chain(a, ids)
    assert cache.chain(b, ids) == b.hash_prompt(ids)
    assert cache.chain(a, ids, "s") == a.hash_prompt(ids, "s")


def test_bounded():
    hasher = BlockHasher("m", 4)
    cache = ChainCache(max_bytes=10_000, min_blocks=2)
    for i in range(200):
        cache.chain(hasher, [i] + list(range(400)))
    assert cache._bytes <= 10_000


def test_ids_that_cannot_be_hashed_are_refused_as_before():
    cache = ChainCache(min_blocks=2)
    with pytest.raises(ValueError):
        cache.chain(BlockHasher("m", 4), [1, 2, -3] + list(range(60)))


def test_a_prompt_that_extends_a_kept_one_not_first_in_its_list_replaces_it():
    # a regression: kept entries were compared by their arrays (numpy raised on unequal lengths)
    hasher = BlockHasher("m", 16)
    cache = ChainCache()
    y = [1] * 16 + list(range(40_000))
    x = [1] * 16 + [5] * 50_000
    cache.chain(hasher, y)
    cache.chain(hasher, x)
    longer = y + list(range(4_000))
    assert cache.chain(hasher, longer) == hasher.hash_prompt(longer)
    kept = next(iter(cache._entries.values()))
    assert [len(e.ids) for e in kept] == [len(longer) // 16 * 16, len(x) // 16 * 16]  # y is gone: longer holds it

"""The block-hash spec: docs/block-hashing.md's vectors, checked two independent ways."""

from __future__ import annotations

import hashlib
import json
import re
import struct

import pytest
import xxhash

from kvmesh.contract.block_hash import SHA256_128, XXH3_128, BlockHasher, algorithm_name
from tests.support import repo_root


def doc_vectors() -> list[dict]:
    text = (repo_root() / "docs" / "block-hashing.md").read_text()
    block = re.search(r"```json\n(.*?)\n```", text, re.S)
    assert block, "docs/block-hashing.md must hold a ```json block of vectors"
    return json.loads(block.group(1))


def spec_from_text(v: dict) -> tuple[str, list[str]]:
    """A re-implementation of the spec as written in the doc, sharing no code with the module."""

    def field(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<I", len(raw)) + raw

    def h(data: bytes) -> bytes:
        if v["algorithm"] == "sha256_128":
            return hashlib.sha256(data).digest()[:16]
        return xxhash.xxh3_128(data).digest()

    root = h(field(v["model_id"]) + field(v["algorithm"]) + field(v["cache_salt"]))
    extra = b"".join(field(k) for k in v["extra_keys"])
    out, parent, bs, ids = [], root, v["block_size"], v["token_ids"]
    for i in range(len(ids) // bs):
        parent = h(parent + b"".join(struct.pack("<i", t) for t in ids[i * bs:(i + 1) * bs]) + extra)
        out.append(parent.hex())
    return root.hex(), out


@pytest.mark.parametrize("vector", doc_vectors(), ids=lambda v: f"{v['algorithm']}-{v['model_id']}-{len(v['token_ids'])}")
def test_doc_vectors_match_module_and_spec_text(vector):
    hasher = BlockHasher(vector["model_id"], vector["block_size"], vector["algorithm"], vector["extra_keys"])
    assert hasher.root(vector["cache_salt"]).hex() == vector["root"]
    assert [x.hex() for x in hasher.hash_prompt(vector["token_ids"], vector["cache_salt"])] == vector["block_hashes"]
    assert spec_from_text(vector) == (vector["root"], vector["block_hashes"])


def test_vectors_cover_the_spec():
    vs = doc_vectors()
    assert {v["algorithm"] for v in vs} == {SHA256_128, XXH3_128}
    assert any(v["cache_salt"] for v in vs) and any(v["extra_keys"] for v in vs)
    assert any(len(v["token_ids"]) % v["block_size"] for v in vs)  # a partial tail block
    assert any(v["block_hashes"] == [] for v in vs)  # less than one block


def test_chain_properties():
    h = BlockHasher("m", 4)
    ids = list(range(12))
    full = h.hash_prompt(ids)
    assert len(full) == 3 and all(len(x) == 16 for x in full)
    assert h.hash_prompt(ids[:9]) == full[:2]  # partial tail ignored
    assert h.hash_prompt(ids[4:], parent=full[0]) == full[1:]  # continuing a chain
    assert h.hash_block(full[1], ids[8:12]) == full[2]
    assert h.hash_prompt(ids, cache_salt="a") != full
    assert BlockHasher("m2", 4).hash_prompt(ids) != full
    assert BlockHasher("m", 4, XXH3_128).hash_prompt(ids) != full
    assert BlockHasher("m", 4, extra_keys=["lora"]).hash_prompt(ids) != full
    # A different first block changes every later hash (chaining).
    assert set(h.hash_prompt([99] + ids[1:])).isdisjoint(full)


def test_bad_inputs_are_rejected_clearly():
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        BlockHasher("m", 16, "md5")
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        BlockHasher("m", 0)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2147483647\]"):
        BlockHasher("m", 2).hash_prompt([1, -5])
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        BlockHasher("m", 4).hash_block(b"\0" * 16, [1, 2])
    assert algorithm_name("XXH3") == XXH3_128 and algorithm_name("sha256") == SHA256_128

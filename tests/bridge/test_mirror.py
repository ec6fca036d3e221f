"""The engine mirror: re-hashing with kvmesh's spec, re-chunking, de-duplication, what it skips,
and a random engine against a plain oracle."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.bridge.engine_events import EngineCleared, EngineRemoved, EngineStored, decode_batch
from kvmesh.bridge.mirror import EngineMirror, check_block_sizes
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from tests.support.mirror import HASH, MODEL, check_vllm_offload_streams


def stored(hashes, parent, tokens, bs=32, **kw) -> EngineStored:
    return EngineStored(tuple(hashes), parent, tuple(tokens), bs, **kw)


def test_real_vllm_batches_give_the_routers_chain():
    """The bytes vLLM 0.32 published for three prompts: the index gets exactly the block hashes
    the router computes for the same token ids (kvmesh's spec), salted ones under their salt."""
    data = json.loads((Path(__file__).parent / "data" / "vllm_0.32.0_batches.json").read_text())
    m = EngineMirror(MODEL, 16, "sha256_128")
    out = []
    for b in data["batches"]:
        for ev in decode_batch(base64.b64decode(b["payload_b64"])).events:
            out += m.apply(ev)
    assert out[0] == BlockStored(HASH.hash_prompt(data["prompts"]["0"]))  # 96 tokens: 6 blocks of 16
    assert out[2] == BlockStored(HASH.hash_prompt(data["prompts"]["2"], cache_salt="tenant-a"))
    assert len(m) == 6 + 4 + 6 and not m.skipped


def test_duplicates_are_counted_and_forwarded_once():
    m = EngineMirror(MODEL, 16, "sha256_128")
    toks = list(range(64))
    first = m.apply(stored([1, 2], None, toks))
    assert first == [BlockStored(HASH.hash_prompt(toks))]
    assert m.apply(stored([1, 2], None, toks)) == [] and m.duplicates == 2
    assert m.apply(EngineRemoved((2,))) == []  # still held once
    chain = HASH.hash_prompt(toks)
    assert m.apply(EngineRemoved((2,))) == [BlockRemoved(chain[2:])]
    assert m.apply(EngineRemoved((2,))) == [] and m.skipped["unknown_removed"] == 1
    # a child continues from its parent's chain
    more = list(range(64, 96))
    assert m.apply(stored([3], 1, more)) == [BlockStored(HASH.hash_prompt(toks[:32] + more)[2:], chain[1])]


def test_pages_smaller_than_a_block_complete_it_every_nth_page():
    # SGLang: one BlockStored per page of 1 token; kvmesh blocks of 4
    h = BlockHasher(MODEL, 4)
    m = EngineMirror(MODEL, 4, "sha256_128")
    out = []
    for i in range(10):
        out += m.apply(stored([100 + i], None if i == 0 else 99 + i, [i], bs=1))
    assert [e.block_hashes for e in out] == [[x] for x in h.hash_prompt(list(range(10)))]
    # evicting the page that completed block 1 (token 7) removes it; pages 8, 9 complete nothing
    assert m.apply(EngineRemoved((109, 108))) == []
    assert m.apply(EngineRemoved((107,))) == [BlockRemoved([h.hash_prompt(list(range(8)))[1]])]


def test_salt_and_lora_enter_kvmesh_hashes_as_kvmesh_defines_them():
    m = EngineMirror(MODEL, 16, "sha256_128")
    toks = list(range(32))
    (salted,) = m.apply(stored([1], None, toks, extra_keys=(("tenant",),)))
    assert salted.block_hashes == HASH.hash_prompt(toks, cache_salt="tenant")
    (lora,) = m.apply(stored([2], None, toks, lora_name="ad", extra_keys=(("ad", "tenant"),)))
    assert lora.block_hashes == BlockHasher(MODEL, 16, extra_keys=("ad",)).hash_prompt(toks, cache_salt="tenant")


@pytest.mark.parametrize(("event", "reason"), [
    (stored([1], None, range(32), extra_keys=((("mm-hash", 0),),)), "unhashable"),
    (stored([1], None, range(32), extra_keys=((b"\x00" * 32,),)), "unhashable"),
    (stored([1], None, range(32), medium="EXTERNAL"), "medium"),  # SGLang: another machine's memory
    (EngineStored((1,), None, (), 0, medium="CPU"), "unknown_block"),  # names a block never seen
    (stored([1], None, range(32), spec_kind="sliding_window", sliding_window=128), "not_full_attention"),
    (stored([1], None, range(24), bs=24), "block_size"),
    (stored([1], 77, range(32)), "orphan"),
])
def test_blocks_kvmesh_cannot_index_are_skipped_and_counted(event, reason):
    m = EngineMirror(MODEL, 16, "sha256_128")
    assert m.apply(event) == [] and m.skipped == {reason: 1} and len(m) == 0


def test_offloaded_blocks_become_host_tier_events_and_a_removal_from_cpu_removes_them():
    """vLLM's offloading connectors store a GPU block to CPU memory ("CPU"); the self-describing
    form carries its tokens and parent like a GPU store. Each tier is counted on its own."""
    m = EngineMirror(MODEL, 16, "sha256_128")
    toks = list(range(64))  # two vLLM blocks of 32: four kvmesh blocks
    chain = HASH.hash_prompt(toks)
    assert m.apply(stored([1, 2], None, toks)) == [BlockStored(chain)]
    assert m.apply(stored([1, 2], None, toks, medium="CPU")) == [BlockStored(chain, tier=Tier.HOST)]
    assert m.apply(stored([2], 1, toks[32:], medium="CPU")) == [] and m.duplicates == 1  # a second CPU store
    # The GPU evicts block 2: the device loses its kvmesh blocks, the host keeps them.
    assert m.apply(EngineRemoved((2,), medium="GPU")) == [BlockRemoved(chain[2:])]
    assert (m.snapshot(), m.snapshot(Tier.HOST), m.holds(2)) == (chain[:2], chain, True)
    # Loaded back to the GPU: a GPU store again, parented on the device's chain.
    assert m.apply(stored([2], 1, toks[32:])) == [BlockStored(chain[2:], chain[1])]
    # A removal from CPU removes the host tier's blocks only (block 2 was stored there twice).
    assert m.apply(EngineRemoved((1, 2), medium="CPU")) == [BlockRemoved(chain[:2], tier=Tier.HOST)]
    assert m.apply(EngineRemoved((2,), medium="CPU")) == [BlockRemoved(chain[2:], tier=Tier.HOST)]
    assert (len(m), m.held(Tier.HOST)) == (4, 0)
    assert m.apply(EngineRemoved((2,), medium="CPU")) == [] and m.skipped["unknown_removed"] == 1
    # SGLang's pinned host memory is the host tier; vLLM's STORAGE and SGLang's DISK the disk tier.
    assert m.apply(stored([1], None, toks[:32], medium="CPU_PINNED")) == [BlockStored(chain[:2], tier=Tier.HOST)]
    assert m.apply(stored([1], None, toks[:32], medium="STORAGE")) == [BlockStored(chain[:2], tier=Tier.DISK)]
    assert m.apply(EngineRemoved((1,), medium="DISK")) == [BlockRemoved(chain[:2], tier=Tier.DISK)]


def test_a_store_that_names_its_blocks_only_is_resolved_through_the_engines_gpu_store():
    """vLLM's OffloadingConnector by default sends a CPU store as the block's hash alone (no tokens,
    block_size 0): the mirror knows the block from its GPU store, and keeps it while the CPU holds it."""
    m = EngineMirror(MODEL, 16, "sha256_128")
    toks = list(range(64))
    chain = HASH.hash_prompt(toks)
    m.apply(stored([1, 2], None, toks))
    assert m.apply(EngineStored((2, 1), None, (), 0, medium="CPU")) == [BlockStored(chain[2:] + chain[:2],
                                                                                     tier=Tier.HOST)]
    assert m.apply(EngineRemoved((1, 2))) == [BlockRemoved(chain[:2] + chain[2:])]  # medium None: the GPU
    assert m.holds(1) and m.holds(2) and len(m) == 0
    # Evicted from CPU too: the engine block is gone, a later GPU store of a child is an orphan.
    assert m.apply(EngineRemoved((2,), medium="CPU")) == [BlockRemoved(chain[2:], tier=Tier.HOST)]
    assert not m.holds(2) and m.engine_blocks == 1
    assert m.apply(stored([3], 2, range(64, 96))) == [] and m.skipped["orphan"] == 1


def test_vllm_offloading_connector_events_become_host_tier_events():
    check_vllm_offload_streams(json.loads((Path(__file__).parent / "data" / "vllm_0.32.0_offload_batches.json")
                                          .read_text()))


def test_clear_overflow_and_block_size_check():
    m = EngineMirror(MODEL, 16, "sha256_128", max_entries=2)
    m.apply(stored([1], None, range(32)))
    m.apply(stored([2], 1, range(32, 64)))
    out = m.apply(stored([3], 2, range(64, 96)))
    assert out[1] == BlockRemoved(HASH.hash_prompt(list(range(32)))) and m.skipped["overflow"] == 1
    assert m.apply(EngineCleared()) == [AllBlocksCleared()] and len(m) == 0 and m.engine_blocks == 0
    check_block_sizes(128, 16)
    check_block_sizes(1, 16)
    with pytest.raises(ValueError, match="do not divide each other"):
        check_block_sizes(24, 16)


# -- a random engine against an oracle ---------------------------------------------------------
@st.composite
def engine_runs(draw):
    kv_bs = draw(st.sampled_from([2, 4]))
    engine_bs = draw(st.sampled_from([1, 2, 4, 8]))
    ops = draw(st.lists(st.tuples(st.sampled_from(["store", "store", "dup", "remove", "offload", "clear"]),
                                  st.integers(0, 10**6), st.integers(0, 1),
                                  st.lists(st.integers(0, 3), min_size=engine_bs, max_size=engine_bs),
                                  st.sampled_from(["GPU", "GPU", "CPU"])),
                        max_size=40))
    return kv_bs, engine_bs, ops


@settings(max_examples=300, deadline=None)
@given(engine_runs())
def test_mirror_and_forwarded_events_agree_with_the_engines_cache(run):
    """The engine's cache: engine blocks named by (token path, variant), with refcounts per medium
    (GPU, CPU). A variant is an engine key kvmesh does not hash (vLLM's seed, a 64-bit hash
    collision): two engine blocks, one kvmesh block. Per tier, the mirror's kvmesh blocks must be
    exactly those whose last token lies in an engine block held in that medium, and the events it
    forwarded, replayed into one set per tier (as an index that keeps tiers would), the same sets.
    ``offload`` is the token-less CPU store of a held block (vLLM's OffloadingConnector)."""
    kv_bs, ebs, ops = run
    h = BlockHasher(MODEL, kv_bs)
    m = EngineMirror(MODEL, kv_bs, "sha256_128")
    tier_of = {"GPU": Tier.DEVICE, "CPU": Tier.HOST}
    refs: dict[tuple[tuple[tuple[int, ...], int], str], int] = {}
    index: dict[Tier, set[bytes]] = {Tier.DEVICE: set(), Tier.HOST: set()}
    ids: dict[tuple[tuple[int, ...], int], int] = {}

    def hid(key):
        return ids.setdefault(key, len(ids) + 1)

    for kind, pick, variant, tokens, medium in ops:
        held_any = sorted({k for (k, _), n in refs.items() if n > 0})
        held = sorted(k for (k, md), n in refs.items() if n > 0 and md == medium)
        if kind == "store":
            # NOTE: an engine stores a child only while its parent is in the same medium or the GPU.
            parent = held_any[pick % len(held_any)] if held_any and pick % 3 else None
            key = ((parent[0] if parent else ()) + tuple(tokens), variant)
            ev = stored([hid(key)], hid(parent) if parent else None, tokens, bs=ebs, medium=medium)
            refs[key, medium] = refs.get((key, medium), 0) + 1
        elif kind == "offload" and held_any:
            key = held_any[pick % len(held_any)]
            ev = EngineStored((hid(key),), None, (), 0, medium="CPU")
            refs[key, "CPU"] = refs.get((key, "CPU"), 0) + 1
        elif kind in ("dup", "remove") and held:
            key = held[pick % len(held)]
            if kind == "remove":
                ev = EngineRemoved((hid(key),), medium=medium)
                refs[key, medium] -= 1
            else:
                parents = [k for k in ids if k[0] == key[0][:-ebs]] if len(key[0]) > ebs else []
                ev = stored([hid(key)], hid(parents[0]) if parents else None, key[0][-ebs:], bs=ebs, medium=medium)
                refs[key, medium] += 1
        elif kind == "clear":
            ev = EngineCleared()
            refs.clear()
        else:
            continue
        for out in m.apply(ev):
            if isinstance(out, AllBlocksCleared):
                for held_set in index.values():
                    held_set.clear()
                continue
            held_set = index[out.tier]
            if isinstance(out, BlockStored):
                assert not held_set & set(out.block_hashes)
                held_set |= set(out.block_hashes)
            else:
                assert set(out.block_hashes) <= held_set
                held_set -= set(out.block_hashes)
        for medium, tier in tier_of.items():
            expected = set()
            for ((path, _), md), n in refs.items():
                if n <= 0 or md != medium:
                    continue
                chain = h.hash_prompt(list(path))
                start = len(path) - ebs  # the block's first token
                expected |= {c for j, c in enumerate(chain) if (j + 1) * kv_bs > start}
            # NOTE: a stored block whose parent the engine already evicted is an orphan in a real
            # engine too; this oracle only stores children of held blocks, so nothing is skipped here.
            assert set(m.snapshot(tier)) == expected == index[tier], medium

"""Prompt bounds, bounded tokenization and what a refused Lookup does to the index breaker.

The process-level proofs (a huge text refused before tokenizing, other requests served while a
long text is tokenized, the index staying on) are in tests/services/test_bad_input.py; these
pin the pieces they rest on.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import InvalidArgument, ResourceExhausted
from kvmesh.contract.index_protocol import IndexUnavailable
from kvmesh.contract.limits import cap_message, check_id, excerpt
from kvmesh.contract.types import ModelSpec
from kvmesh.kv_client.router_client import KVServiceClient
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import train_tokenizer
from kvmesh.router.core.decide import plan_now
from kvmesh.router.core.observer import CountingObserver
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import WorkerEndpoint
from kvmesh.router.text.prompt import PromptLimits, PromptTokenizer
from kvmesh.transport.loop import LoopThread
from kvmesh.transport.wire import invalid_utf8_field
from kvmesh.v1 import router_pb2

SPEC = ModelSpec("m", 4, "sha256_128")
PROMPT = list(range(1, 33))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_excerpt_and_cap_keep_messages_short():
    assert excerpt("w" * 70_000) == f"{'w' * 40!r}… (70000 characters)"
    assert excerpt("short") == "'short'"
    capped = cap_message("é" * 5000)
    assert len(capped.encode()) <= 1024 and capped.endswith("(message truncated)")
    with pytest.raises(InvalidArgument, match="has 200 characters; at most 128"):
        check_id("request_id", "r" * 200, 128)
    with pytest.raises(InvalidArgument, match="not printable ASCII"):
        check_id("request_id", "a\nforged log line", 128)
    with pytest.raises(InvalidArgument, match="not printable ASCII"):
        check_id("request_id", "café", 128)  # it goes back in an HTTP/2 header (trailers)
    check_id("request_id", "", 128, allow_empty=True)


def test_limits_default_to_the_model_context_and_name_the_flag_when_set():
    derived = PromptLimits.resolve(None, None, 512, 16)
    assert (derived.max_tokens, derived.max_bytes, derived.explicit_tokens) == (511, 32 * 511, False)
    with pytest.raises(InvalidArgument, match="600 tokens; at most 511 fit .the model's context is 512"):
        derived.check_tokens(600)
    derived.check_tokens(511)
    flagged = PromptLimits.resolve(300, 1000, 512, 16)
    with pytest.raises(ResourceExhausted, match=r"at most 300 \(--max-prompt-tokens\)"):
        flagged.check_tokens(301)
    with pytest.raises(ResourceExhausted, match=r"more than 1001 bytes.*--max-prompt-bytes"):
        flagged.check_bytes("x" * 1001)
    with pytest.raises(ResourceExhausted, match="is 1002 bytes"):
        flagged.check_bytes("é" * 501)  # 501 characters, 1002 bytes
    unknown = PromptLimits.resolve(None, None, None, 16)
    assert unknown.max_tokens == 65_536 * 16  # the index's Lookup bound
    off = PromptLimits.resolve(0, 0, 512, 16)
    off.check_tokens(10**7)
    off.check_bytes("x" * 10**6)


def test_bounded_tokenizer_stops_in_the_first_piece_and_matches_encode_when_it_fits(tokenizer):
    seen: list[int] = []
    prompts = PromptTokenizer(tokenizer, seen.append)
    limits = PromptLimits.resolve(None, None, 512, 16)

    async def encode(text: str) -> list[int]:
        return await prompts.encode(text, limits)

    text = "a " * 8000  # under the byte bound, thousands of tokens
    with pytest.raises(InvalidArgument, match="more than 511 tokens"):
        asyncio.run(encode(text))
    assert 0 < sum(seen) <= 4096 < len(text)
    fitting = "Hello there. " * 20
    assert asyncio.run(encode(fitting)) == tokenizer.encode(fitting, add_special_tokens=True).ids
    prompts.close()


def test_a_long_text_that_fits_is_counted_in_pieces_then_encoded_whole():
    """A word-level tokenizer makes 21 bytes one token: 6,300 bytes are 300 tokens, so the text
    goes through the counting pieces (over 4 bytes per allowed token) and still fits."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "supercalifragilistic", "antidisestablishment"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    seen: list[int] = []
    prompts = PromptTokenizer(tok, seen.append)
    limits = PromptLimits.resolve(400, None, None, 16)
    text = "supercalifragilistic antidisestablishment " * 150
    ids = asyncio.run(prompts.encode(text, limits))
    assert ids == tok.encode(text).ids and len(ids) == 300
    assert len(seen) == 3 and sum(seen[:-1]) == len(text) == seen[-1]  # two counting pieces, then the whole
    with pytest.raises(ResourceExhausted, match="more than 400 tokens"):
        asyncio.run(prompts.encode(text * 2, limits))
    prompts.close()


class Index:
    def __init__(self, cause: str) -> None:
        self.cause, self.calls = cause, 0

    def lookup(self, model_id, chain):
        self.calls += 1
        raise IndexUnavailable("refused", self.cause)


def test_a_refused_lookup_does_not_open_the_breaker_a_failed_one_does():
    obs = CountingObserver()
    core = RoutingCore(make_policy("kv-aware", PolicyConfig(seed=0)), speculative_ttl_s=0, index_retry_s=60.0,
                       observer=obs)
    eps = [WorkerEndpoint("w1", "a:1")]
    refused = Index("lookup_invalid")
    for _ in range(3):
        assert not plan_now(core, SPEC, PROMPT, eps, refused).query.index_ok
    assert refused.calls == 3 and obs.fallbacks == {"lookup_invalid": 3}  # asked every time
    failed = Index("lookup_failed")
    plan_now(core, SPEC, PROMPT, eps, failed)
    plan_now(core, SPEC, PROMPT, eps, failed)
    assert failed.calls == 1 and obs.fallbacks["index_down"] == 1  # the breaker is open now


def test_kv_service_client_tells_a_refused_lookup_from_an_unreachable_index():
    kv = KVServiceServer(MemoryIndex(), "127.0.0.1", free_port()).start()
    loop = LoopThread("test-client")
    try:
        async def cause(target: str, model_id: str) -> str:
            client = KVServiceClient(target, lookup_timeout_s=2.0)
            try:
                await client.lookup(model_id, BlockHasher("m", 4).hash_prompt(PROMPT))
            except IndexUnavailable as exc:
                return exc.cause
            finally:
                await client.close()
            return "answered"

        assert loop.run(cause(f"127.0.0.1:{kv.port}", "m")) == "answered"
        assert loop.run(cause(f"127.0.0.1:{kv.port}", "m" * 600)) == "lookup_invalid"  # model_id over 512
        assert loop.run(cause(f"127.0.0.1:{free_port()}", "m")) == "lookup_failed"
    finally:
        loop.stop()
        kv.stop(0)


def test_invalid_utf8_field_names_the_nested_field():
    ok = router_pb2.GenerateRequest(text="fine", request_id="r").SerializeToString()
    assert invalid_utf8_field(router_pb2.GenerateRequest.DESCRIPTOR, ok) is None
    bad = ok + b"\x22\x02\xff\xfe"  # field 4 (cache_salt)
    assert invalid_utf8_field(router_pb2.GenerateRequest.DESCRIPTOR, bad) == "cache_salt"
    from kvmesh.v1 import kv_service_pb2 as kpb

    inner = b"\x0a\x02\xc3\x28"  # ListWorkersResponse.workers[1].worker_id
    data = b"\x0a\x00" + b"\x0a" + bytes([len(inner)]) + inner
    assert invalid_utf8_field(kpb.ListWorkersResponse.DESCRIPTOR, data) == "workers[1].worker_id"
    assert invalid_utf8_field(router_pb2.GenerateRequest.DESCRIPTOR, b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff") \
        is None  # not protobuf at all: no field to name

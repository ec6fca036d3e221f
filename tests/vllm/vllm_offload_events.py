"""vLLM's own CPU-offloading events, made by vLLM 0.32's code in the peer virtualenv and printed as the
bytes its publisher would send.

vLLM's offloading cannot run on its CPU build (vllm/v1/kv_offload/cpu/gpu_worker.py asserts CUDA or
XPU tensors), so this drives the scheduler-side parts that decide and describe the offloaded blocks,
unchanged: ``CPUOffloadingManager`` (vllm/v1/kv_offload/cpu/manager.py: the LRU of CPU chunks and its
``OffloadingEvent``s), ``OffloadingEventsTracker`` (vllm/distributed/kv_transfer/kv_connector/v1/
offloading/events.py: those events as KV events, in the default form that names a block by its hash
alone, and in the ``self_describing_kv_events`` form with tokens and parent), the ``BlockStored`` /
``BlockRemoved`` / ``KVEventBatch`` structs (vllm/distributed/kv_events.py) and its encoder
(``msgspec.msgpack.Encoder``, as ``ZmqEventPublisher`` encodes a batch). GPU events are built as
vLLM's block pool builds them (vllm/v1/core/block_pool.py), block hashes by vLLM's own
``hash_block_tokens`` (sha256) and ``maybe_convert_block_hash`` (the low 64 bits, its default).

    python vllm_offload_events.py > batches.json

Prints {"vllm": version, "prompts": {...}, "streams": {"default": [...], "self_describing": [...]}},
each stream a list of {"seq", "payload_b64", "what"} of one engine's event stream:
  0  GPU: P's four blocks stored                 1  CPU: P's four blocks offloaded
  2  GPU: P's last two blocks evicted, Q stored  3  CPU: Q offloaded, evicting P's first two (LRU)
  4  GPU: P's first two blocks evicted (the CPU's copies of blocks 2, 3 remain)
"""

from __future__ import annotations

import base64
import json
import sys
from types import SimpleNamespace

import msgspec
import vllm
from vllm.distributed.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import OffloadingKVEventsConfig, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

BLOCK = 32
PROMPTS = {"P": list(range(10, 10 + 4 * BLOCK)), "Q": list(range(300, 300 + 2 * BLOCK))}


def block_hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    parent = None
    for i in range(0, len(tokens), BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i:i + BLOCK])
        out.append(parent)
    return out


def gpu_stored(tokens: list[int], hashes: list[bytes]) -> BlockStored:
    return BlockStored(block_hashes=[maybe_convert_block_hash(h) for h in hashes], parent_block_hash=None,
                       token_ids=tokens, block_size=BLOCK, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                       extra_keys=[None] * len(hashes), group_idx=0, kv_cache_spec_kind="full_attention")


def gpu_removed(hashes: list[bytes]) -> list[BlockRemoved]:
    # NOTE: vLLM's block pool sends one BlockRemoved per evicted block.
    return [BlockRemoved(block_hashes=[maybe_convert_block_hash(h)], medium=MEDIUM_GPU, group_idx=0) for h in hashes]


def stream(self_describing: bool) -> list[dict]:
    hashes = {name: block_hashes(toks) for name, toks in PROMPTS.items()}
    keys = {name: [make_offload_key(h, 0) for h in hs] for name, hs in hashes.items()}
    manager = CPUOffloadingManager(num_chunks=4, enable_events=True)
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(enable_kv_cache_events=True,
                                                               self_describing_kv_events=self_describing))
    group = SimpleNamespace(group_idx=0, tokens_per_block=BLOCK, tokens_per_chunk=BLOCK, hashes_per_chunk=1,
                            sliding_window_size_in_chunks=None,
                            kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None))

    def offload(name: str) -> list:
        """The connector's store of a request's blocks: prepare, record (its scheduler does, per
        chunk), complete; then the KV events the tracker makes of the manager's events."""
        ctx = ReqContext(req_id=name)
        request = SimpleNamespace(block_hashes=hashes[name], all_token_ids=PROMPTS[name], lora_request=None)
        out = manager.prepare_store(keys[name], ctx)
        assert out is not None and out.keys_to_store == keys[name]
        for i, key in enumerate(keys[name]):
            tracker.record_store(request, group, i, key)
        manager.complete_store(keys[name], ctx)
        return list(tracker.take_events(manager.take_events()))

    steps = [
        ("GPU: P stored", [gpu_stored(PROMPTS["P"], hashes["P"])]),
        ("CPU: P offloaded", offload("P")),
        ("GPU: P's blocks 2, 3 evicted; Q stored", gpu_removed(hashes["P"][2:]) + [gpu_stored(PROMPTS["Q"], hashes["Q"])]),
        ("CPU: Q offloaded, P's blocks 0, 1 evicted", offload("Q")),
        ("GPU: P's blocks 0, 1 evicted", gpu_removed(hashes["P"][:2])),
    ]
    encoder = msgspec.msgpack.Encoder()
    return [{"seq": i, "what": what,
             "payload_b64": base64.b64encode(encoder.encode(KVEventBatch(ts=1.0 + i, events=events,
                                                                          data_parallel_rank=0))).decode()}
            for i, (what, events) in enumerate(steps)]


def main() -> None:
    init_none_hash(sha256)
    json.dump({"vllm": vllm.__version__, "block_size": BLOCK, "prompts": PROMPTS,
               "streams": {"default": stream(False), "self_describing": stream(True)}}, sys.stdout)
    print()


if __name__ == "__main__":
    main()

"""What the bridge's mirror must make of vLLM's offloading events (tests/bridge/ and tests/vllm/ both check it)."""

from __future__ import annotations

import base64

from kvmesh.bridge.engine_events import decode_batch
from kvmesh.bridge.mirror import EngineMirror
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import BlockRemoved, BlockStored, Tier

MODEL = "default"
HASH = BlockHasher(MODEL, 16)


def check_vllm_offload_streams(doc: dict) -> None:
    """vLLM 0.32's offloading events (tests/vllm/vllm_offload_events.py: its CPUOffloadingManager,
    OffloadingEventsTracker and encoder), in both forms, through the decoder and the mirror: CPU
    stores are host-tier stores of the blocks' kvmesh chain, a CPU eviction removes them from the
    host tier only, GPU events stay the device's."""
    p, q = HASH.hash_prompt(doc["prompts"]["P"]), HASH.hash_prompt(doc["prompts"]["Q"])
    H, D = Tier.HOST, Tier.DEVICE
    want = [
        [BlockStored(p)],
        [BlockStored(p[i:i + 2], tier=H) for i in (0, 2, 4, 6)],  # one event per offloaded vLLM block
        [BlockRemoved(p[4:6]), BlockRemoved(p[6:8]), BlockStored(q)],
        [BlockRemoved(p[:4], tier=H), BlockStored(q[:2], tier=H), BlockStored(q[2:], tier=H)],
        [BlockRemoved(p[:2]), BlockRemoved(p[2:4])],
    ]
    held = [(p, set()), (p, set(p)), (p[:4] + q, set(p)), (p[:4] + q, set(p[4:] + q)), (q, set(p[4:] + q))]
    for form in ("default", "self_describing"):
        m = EngineMirror(MODEL, 16, "sha256_128")
        for step, b in enumerate(doc["streams"][form]):
            batch = decode_batch(base64.b64decode(b["payload_b64"]))
            assert not batch.bad and not batch.unknown
            assert m.apply_all(batch.events) == want[step], (form, b["what"])
            assert (m.snapshot(D), set(m.snapshot(H))) == held[step], (form, b["what"])
        assert not m.skipped and m.held(D) == 4 and m.held(H) == 8
    default = decode_batch(base64.b64decode(doc["streams"]["default"][1]["payload_b64"])).events[0]
    assert (default.medium, default.token_ids, default.block_size) == ("CPU", (), 0)  # names its block only

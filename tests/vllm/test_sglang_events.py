"""SGLang's own publisher and encoder (sglang 0.5.23, peer virtualenv) into kvmesh's event stream,
decoder and mirror: pages of one token become kvmesh blocks of 16, the salt field is the chain's
salt, removals and clears follow, and a late subscriber recovers everything by replay."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time

from kvmesh.bench.vllm_peer import peer_python
from kvmesh.bridge.engine_events import decode_batch
from kvmesh.bridge.event_stream import Batch, EngineEventStream
from kvmesh.bridge.mirror import EngineMirror
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.loopback import free_port

HERE = __file__.rsplit("/", 1)[0]


def page_hash(parent: int | None, token: int) -> int:
    """A page's hash as SGLang publishes it: a signed int64 of a SHA-256 (of the parent and token)."""
    raw = hashlib.sha256(f"{parent}:{token}".encode()).digest()[:8]
    return int.from_bytes(raw, "big", signed=True)


def pages(tokens: list[int], parent: int | None = None) -> list[list]:
    out = []
    for t in tokens:
        h = page_hash(parent, t)
        out.append([h, parent, t])
        parent = h
    return out


def test_sglang_publisher_to_kvmesh_blocks(tmp_path):
    a = list(range(100, 140))  # 40 pages: 2 full kvmesh blocks of 16 (+ 8 pending)
    b = list(range(500, 532))  # 32 pages under a salt
    a_pages, b_pages = pages(a), pages(b)
    script = [{"store": a_pages[:20]}, {"store": a_pages[20:]}, {"store": b_pages, "salt": "tenant"},
              {"remove": [p[0] for p in a_pages[31:]]}, {"clear": True}]
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    pub, rep = free_port(), free_port()
    proc = subprocess.Popen([str(peer_python()), f"{HERE}/sglang_publisher.py", str(pub), str(rep), str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # NOTE: the stream connects after SGLang published nothing yet, but listens only from its
        # handshake on: the whole script comes live or by replay, in order, either way.
        stream = EngineEventStream(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", replay_timeout_s=2.0)
        stream.connect()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "done"
        batches: list[Batch] = []
        deadline = time.monotonic() + 10
        while len(batches) < len(script) and time.monotonic() < deadline:
            batches += [i for i in stream.poll(0.1) if isinstance(i, Batch)]
        assert [b.seq for b in batches] == list(range(len(script)))
        decoded = [decode_batch(b.payload) for b in batches]
        assert decoded[0].rank == 0 and not any(d.bad or d.unknown for d in decoded)
        m = EngineMirror("default", 16, "sha256_128")
        out = [m.apply_all(d.events) for d in decoded]
        h = BlockHasher("default", 16)
        chain_a, chain_b = h.hash_prompt(a), h.hash_prompt(b, cache_salt="tenant")
        assert out[0] == [BlockStored(chain_a[:1])]  # page 16 completes block 0
        assert out[1] == [BlockStored(chain_a[1:2], chain_a[0])]  # page 32 completes block 1
        assert out[2] == [BlockStored([chain_b[0]]), BlockStored([chain_b[1]], chain_b[0])]
        assert out[3] == [BlockRemoved(chain_a[1:2])]  # evicting pages 31.. removes block 1 only
        assert out[4] == [AllBlocksCleared()] and len(m) == 0
        # a subscriber that comes after everything recovers it all by replay from seq 0
        late = EngineEventStream(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}", replay_timeout_s=2.0)
        late.connect()
        assert [i.seq for i in late.attach() if isinstance(i, Batch)] == list(range(len(script)))
        stream.close()
        late.close()
    finally:
        proc.stdin.write("end\n")
        proc.stdin.close()
        proc.wait(10)

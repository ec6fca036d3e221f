"""An endpoint picker's client side in tests: kvmesh/bench/gateway.py's GatewayClient on one loop for the
test module, and the bodies the tests send (tests/services/test_epp.py and others)."""

from __future__ import annotations

from kvmesh.bench.gateway import GatewayClient
from kvmesh.transport.loop import LoopThread

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


_LOOP: LoopThread | None = None


def run(coro):
    """On one client loop for the module (grpc.aio's channels outlive no loop of their own)."""
    global _LOOP
    if _LOOP is None:
        _LOOP = LoopThread("gateway-client")
    return _LOOP.run(coro, timeout=300)


async def _pick(port: int, path: str, body, mode: str = "full-duplex", **kw):
    client = GatewayClient(f"127.0.0.1:{port}")
    try:
        return await client.pick(path, body, mode, **kw)
    finally:
        await client.close()


def pick(port: int, path: str, body, mode: str = "full-duplex", **kw):
    return run(_pick(port, path, body, mode, **kw))


def ids_body(ids: list[int], **extra) -> dict:
    return {"model": "", "prompt": ids, "max_tokens": 4, **extra}

"""The engine's side of prefill/decode disaggregation is touched on the engine's step thread only.

Every P/D path runs between real gRPC workers (a prefill leg and its answer, a decode leg's pull of the blocks
it lacks, the PullKV stream, a ReleaseKV, a hold that expires) while the engine's P/D objects (its connector,
the holds with their dicts, the block pool) record the thread of every attribute read, method call and dict
access. The transfer side (model_worker/serving/kv_transfer.py, on the gRPC event loop) must ask for all of it
through the engine's inbox: a touch from any other thread fails the test, naming the attribute and the stack."""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmesh.loopback import free_port
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.serving.server import WorkerServer
from kvmesh.transport.channels import dial
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.support import wait_until
from tests.support.model_worker import worker_generate

BS = 16


class ThreadAudit:
    """Records which thread touches the audited objects; the step thread is named once the worker exists."""

    def __init__(self) -> None:
        self.owner: threading.Thread | None = None
        self.touches: Counter[str] = Counter()
        self.strays: list[str] = []
        self._lock = threading.Lock()

    def touch(self, what: str) -> None:
        here = threading.current_thread()
        with self._lock:
            self.touches[what] += 1
            if here is not self.owner:
                stack = "".join(traceback.format_stack(limit=8)[:-2])
                self.strays.append(f"{what} on thread {here.name!r}:\n{stack}")

    def watch(self, obj: Any, label: str) -> None:
        """Every attribute of ``obj`` (methods, properties, fields) is recorded when read."""
        audit, cls = self, type(obj)

        def __getattribute__(self, name: str) -> Any:  # noqa: N807 - the hook itself
            if not name.startswith("__"):
                audit.touch(f"{label}.{name}")
            return cls.__getattribute__(self, name)

        obj.__class__ = type(f"Watched{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})

    def watched_dict(self, d: dict, label: str) -> dict:
        """A dict that records every read and write (the holds' maps, which a caller may keep a reference to)."""
        audit = self

        class WatchedDict(dict):
            pass

        for name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__", "get",
                     "pop", "setdefault", "items", "keys", "values"):
            def method(self, *args, _name=name, **kwargs):
                audit.touch(f"{label}.{_name}")
                return getattr(dict, _name)(self, *args, **kwargs)

            setattr(WatchedDict, name, method)
        return WatchedDict(d)


def watch_engine(engine: LLMEngine, audit: ThreadAudit) -> None:
    """The engine's P/D state: its connector, the holds and their maps, the block pool they draw on."""
    holds = engine.kv_connector.holds
    holds.holds = audit.watched_dict(holds.holds, "holds.holds")
    holds.imports = audit.watched_dict(holds.imports, "holds.imports")
    audit.watch(engine.kv_cache_manager.block_pool, "block_pool")
    audit.watch(holds, "holds")
    audit.watch(engine.kv_connector, "kv_connector")


@pytest.fixture
def start_watched(model_dir) -> Iterator[Callable[..., tuple[WorkerServer, ThreadAudit]]]:
    """Starts a worker whose engine's P/D state is watched from before the server is built."""
    started: list[WorkerServer] = []

    def start(worker_id: str, role: str, kv_transport: str, kv_hold_ttl_s: float = 30.0) -> tuple[WorkerServer,
                                                                                                     ThreadAudit]:
        engine = LLMEngine(model=str(model_dir), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
        audit = ThreadAudit()
        watch_engine(engine, audit)
        server = WorkerServer(engine, worker_id, "127.0.0.1", free_port(), None, role=role, kv_transport=kv_transport,
                              kv_hold_ttl_s=kv_hold_ttl_s)
        audit.owner = server.loop.thread
        started.append(server.start())
        return server, audit

    yield start
    for s in started:
        s.stop(0.5)


def ids(n: int, k: int = 0) -> list[int]:
    return [(13 * i + 29 * k + 3) % 500 + 2 for i in range(n)]




def on_step_thread(worker: WorkerServer, fn: Callable[[LLMEngine], Any]) -> Any:
    """What the test itself reads of the engine, read where the engine allows it."""
    return worker.loop.call(fn).result(timeout=10)


def idle(worker: WorkerServer) -> bool:
    def check(e: LLMEngine) -> bool:
        kv = e.kv_cache_manager
        return kv.num_free_blocks == kv.num_blocks - 1 and not e.kv_holds.holds and not e.kv_holds.imports

    return on_step_thread(worker, check)


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_pd_state_is_touched_on_the_engine_thread_only(start_watched, transport):
    (p, p_audit), (d, d_audit) = start_watched("p", "prefill", transport), start_watched("d", "decode", transport)
    short, short_audit = start_watched("p-short", "prefill", transport, kv_hold_ttl_s=0.3)

    # a split request: the prefill leg holds 4 blocks, the decode leg pulls them (the PullKV stream, or NIXL)
    prompt = ids(70)
    _, last = worker_generate(p, prompt, 1, "split", worker_pb2.KVTransfer(do_remote_decode=True))
    assert len(last.kv_source.block_hashes) == 4
    tokens, end = worker_generate(d, prompt, 5, "split", worker_pb2.KVTransfer(source=last.kv_source))
    assert len(tokens) == 5 and end.kv_blocks_pulled == 4 and end.usage.cached_tokens == 4 * BS
    # a hold the router gives up on (ReleaseKV), and one whose ttl ends it
    _, last = worker_generate(p, ids(40, 1), 1, "dropped", worker_pb2.KVTransfer(do_remote_decode=True))
    released = worker_pb2_grpc.WorkerStub(dial(p.address)).ReleaseKV(
        worker_pb2.ReleaseKVRequest(request_id="dropped"), timeout=10)
    assert released.released and len(last.kv_source.block_hashes) == 2
    _, last = worker_generate(short, ids(40, 2), 1, "unpulled", worker_pb2.KVTransfer(do_remote_decode=True))
    assert len(last.kv_source.block_hashes) == 2
    wait_until(lambda: idle(p) and idle(d) and idle(short), timeout=10, what="every hold and import gone")

    # P/D state was touched on the step thread alone ...
    for audit in (p_audit, d_audit, short_audit):
        assert not audit.strays, "P/D state touched off the engine thread:\n" + "\n".join(audit.strays[:3])
    # ... and every path ran on the watched objects (the test cannot pass by watching nothing)
    streamed = ("kv_connector.begin_read", "kv_connector.end_read", "holds.read", "holds.done_reading")
    for what in ("kv_connector.finished", "holds.hold", "kv_connector.release",
                 *(streamed if end.kv_transport == "grpc" else ())):
        assert p_audit.touches[what] > 0, what
    assert short_audit.touches["kv_connector.expire"] > 0 and short_audit.touches["holds.release"] > 0
    for what in ("kv_connector.leading_cached", "holds.take_in", "block_pool.cache_imported", "holds.admitted"):
        assert d_audit.touches[what] > 0, what

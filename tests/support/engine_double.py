"""An engine server's outside, on loopback, as vLLM 0.32 shows it: the KV event publisher (PUB +
replay ROUTER, vllm/distributed/kv_events.py's framing), and /health, /metrics, /v1/models over
HTTP. For the bridge's fast tests; tests/vllm/ runs the real vLLM.

It publishes what a test tells it to, with knobs a real engine does not expose: drop batches on the
PUB socket (as a lagging subscriber loses them), shrink the replay buffer, start a new "process"
(seq from 0, empty buffer), answer /health with 503.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

from kvmesh.bridge.engine_events import encode_batch
from kvmesh.loopback import free_port

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EngineDouble:
    def __init__(self, block_size: int = 32, num_blocks: int = 512, replay: bool = True,
                 buffer_steps: int = 10_000, model: str = "/models/default", sglang_replay: bool = False) -> None:
        self.block_size, self.num_blocks, self.model = block_size, num_blocks, model
        self.sglang_replay = sglang_replay
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.events_port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{self.events_port}")
        self.router = None
        self.replay_port = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = free_port()
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.drop = 0
        self.healthy = True
        self.running = 0
        self.waiting = 0
        self.max_lora = 0
        """> 0: served with --enable-lora (vllm:lora_requests_info on /metrics, adapters on /v1/models)."""
        self.lora_history: list[tuple[str, str]] = []
        """The (running, waiting) label values of each stats log so far (vLLM keeps every label set)."""
        self.adapters: list[str] = []
        """The LoRA modules /v1/models lists, with the model as their parent."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._replay_thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._replay_thread.start()
        self.http_port = free_port()
        self.http = ThreadingHTTPServer(("127.0.0.1", self.http_port), self._handler())
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    # -- events ---------------------------------------------------------------------------------
    def publish(self, events: list[dict]) -> int:
        """One batch; returns its seq. Lost on the PUB socket while ``drop`` > 0 (still buffered)."""
        payload = encode_batch(events, ts=1.0)
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if self.drop > 0:
                self.drop -= 1
            else:
                self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    def store(self, hashes: list[int], parent: int | None, tokens: list[int], **extra) -> int:
        return self.publish([{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                              "token_ids": tokens, "block_size": self.block_size, "lora_id": None,
                              "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes),
                              "group_idx": 0, "kv_cache_spec_kind": "full_attention", **extra}])

    def remove(self, hashes: list[int]) -> int:
        return self.publish([{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}])

    def new_process(self) -> None:
        """The engine restarted: seq from 0, nothing buffered."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        if self.router is None:
            return
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start_seq]
            for s, p in items:
                head = [client, b""] if self.sglang_replay else [client, b"", b""]
                self.router.send_multipart([*head, s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", *([] if self.sglang_replay else [b""]), END_SEQ, b""])

    # -- HTTP -----------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        return (
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            '# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0\n'
            '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{engine="0",model_name="m"} 200.0\n'
            '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{engine="0",model_name="m"} 50.0\n'
            '# TYPE vllm:e2e_request_latency_seconds histogram\n'
            'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 4.0\n'
            'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.0\n'
            f'vllm:cache_config_info{{block_size="{self.block_size}",engine="0",num_gpu_blocks="{self.num_blocks}",'
            'num_cpu_blocks="None"} 1.0\n' + self._lora_text())

    def _lora_text(self) -> str:
        if not self.max_lora:
            return ""
        # NOTE: as vLLM: each log sets its label set to the time; the older ones stay
        return "# TYPE vllm:lora_requests_info gauge\n" + "".join(
            f'vllm:lora_requests_info{{max_lora="{self.max_lora}",running_lora_adapters="{r}",'
            f'waiting_lora_adapters="{w}"}} {1.7e9 + i}\n' for i, (r, w) in enumerate(self.lora_history))

    def models_json(self) -> bytes:
        data = [{"id": self.model, "object": "model", "parent": None}] + [
            {"id": a, "object": "model", "root": f"/adapters/{a}", "parent": self.model} for a in self.adapters]
        return json.dumps({"object": "list", "data": data}).encode()

    def _handler(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    self._send(200 if double.healthy else 503, b"")
                elif self.path == "/metrics":
                    self._send(200, double.metrics_text().encode())
                elif self.path == "/v1/models":
                    self._send(200, double.models_json())
                else:
                    self._send(404, b"")

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def close(self) -> None:
        self._stop.set()
        self._replay_thread.join(2)
        self.http.shutdown()
        self.http.server_close()
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()

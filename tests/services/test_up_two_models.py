"""`kvmesh up --model A --model B`: one router in front of workers of two models, as child processes."""

from __future__ import annotations

import json
import subprocess
import sys

import openai

from kvmesh.client import Client
from kvmesh.loopback import free_port, free_port_run
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.stack import LocalStack, StackConfig

OTHER = ModelSpec(arch="mistral", layers=1, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128,
                  max_position_embeddings=512, seed=3, init_std=0.05)


def test_up_serves_two_models_each_on_its_own_workers(model_dir, tmp_path):
    other = make_model(tmp_path / "tiny-mistral", OTHER)
    http_port = free_port()
    stack = LocalStack(StackConfig(model=str(model_dir), extra_models=[str(other)], workers=1, http_port=http_port,
                                   router_port=free_port(), kv_service_port=free_port(), worker_port=free_port_run(2),
                                   metrics_port=0, store="memory", worker_args=["--num-blocks=64"],
                                   log_dir=str(tmp_path / "logs"))).start()
    try:
        assert stack.endpoints["openai"] == f"http://127.0.0.1:{http_port}/v1"
        client = openai.OpenAI(base_url=stack.endpoints["openai"], api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [model_dir.name, other.name]
        with Client(stack.endpoints["router"], timeout=60) as grpc_client:
            for model, worker in ((model_dir.name, "worker-0"), (other.name, "worker-1")):
                reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3)
                assert reply.model == model and reply.usage.completion_tokens <= 3
                out = grpc_client.generate([{"role": "user", "content": "hi"}], model=model, max_tokens=3)
                assert out.served_by == worker  # worker i serves model i // --workers
                # The gRPC chat renders the same template: the same prompt tokens as over HTTP.
                assert out.usage.prompt_tokens == reply.usage.prompt_tokens
        cli = subprocess.run([sys.executable, "-m", "kvmesh.cli", "generate", "--router", stack.endpoints["router"],
                              "--model", other.name, "--chat", "--json", "--max-tokens", "2", "hello"],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["served_by"] == "worker-1"
    finally:
        stack.stop()

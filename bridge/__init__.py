"""kvmesh.bridge: another engine's server (vLLM, SGLang) as a kvmesh worker.

One bridge per engine server (or data-parallel rank): it registers the server with the kv_service,
turns the engine's KV events (ZMQ, msgpack) into kvmesh block events hashed with kvmesh's own spec
from the events' token ids, reports the engine's load from its Prometheus metrics, and keeps the
lease. Routers send the server requests directly (router/workers/openai_worker.py), as token ids.
docs/vllm.md.
"""

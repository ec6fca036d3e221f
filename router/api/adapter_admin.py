"""LoRA adapters loaded and unloaded at run time through the router: vLLM's ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` (body ``{"lora_name", "lora_path"}``; kvmesh adds an optional
``"model"``, the base model, default the router's default), fanned out to every live worker of the base
model (a kvmesh worker by its LoadAdapter / UnloadAdapter RPCs, a bridged vLLM by the same HTTP route).

Off unless the router runs with ``--allow-runtime-lora-updating`` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
the path names a directory on every worker's file system. The answer comes once every worker answered and
the router's own view lists the adapter (or no longer does), so the next request may name it.
docs/adapters.md.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvmesh.contract.errors import FailedPrecondition, InvalidArgument, KVMeshError, Unavailable
from kvmesh.contract.limits import MAX_ADAPTER_NAME_CHARS, MAX_ADAPTER_PATH_CHARS
from kvmesh.router.models import ModelSet

VISIBLE_WITHIN_S = 5.0
"""How long the answer waits for the router's view (discovery, every --discovery-interval) to show the change."""


def _name_and_path(body: Any, load: bool) -> tuple[str, str, str]:
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object: {\"lora_name\": ..., \"lora_path\": ...}")
    name, path, model = body.get("lora_name"), body.get("lora_path", ""), body.get("model") or ""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_ADAPTER_NAME_CHARS or not name.isprintable():
        raise InvalidArgument(f"lora_name must be 1-{MAX_ADAPTER_NAME_CHARS} printable characters", param="lora_name")
    if load and (not isinstance(path, str) or not 1 <= len(path) <= MAX_ADAPTER_PATH_CHARS):
        raise InvalidArgument(f"lora_path must be a directory path of 1-{MAX_ADAPTER_PATH_CHARS} characters "
                              "on the workers", param="lora_path")
    if not isinstance(model, str):
        raise InvalidArgument("model must be a string: the base model's id", param="model")
    return name, path, model


async def change_adapter(models: ModelSet, body: Any, load: bool, allowed: bool) -> dict[str, Any]:
    """Loads (or unloads) the adapter on every live worker of its base model; the JSON answer.

    Raises:
        FailedPrecondition: runtime updating is off; InvalidArgument: a bad body; NotFound: no such base model;
        Unavailable: the model has no live worker; the workers' own errors (the first one's type, with every
        worker's message) when one refused.
    """
    if not allowed:
        raise FailedPrecondition("loading LoRA adapters at run time is off on this router: start it with "
                                 "--allow-runtime-lora-updating")
    name, path, model = _name_and_path(body, load)
    served = models.resolve(model)
    endpoints = served.pool.endpoints()
    if not endpoints:
        raise Unavailable(f"model {served.model_id!r} has no live worker to {'load' if load else 'unload'} "
                          f"adapter {name!r} on")
    outcomes = await asyncio.gather(*(served.pool.change_adapter(e, name, path, load) for e in endpoints),
                                    return_exceptions=True)
    failed = [(e.worker_id, o) for e, o in zip(endpoints, outcomes, strict=True) if isinstance(o, BaseException)]
    done = [e.worker_id for e, o in zip(endpoints, outcomes, strict=True) if not isinstance(o, BaseException)]
    if failed:
        first = failed[0][1]
        if not isinstance(first, KVMeshError):
            raise first
        said = "; ".join(f"{w}: {exc}" for w, exc in failed)
        raise type(first)(f"{len(failed)} of {len(endpoints)} workers refused ({said})"
                          + (f"; done on {', '.join(done)}" if done else ""))
    deadline = time.monotonic() + VISIBLE_WITHIN_S
    while (name in models.adapters()) != load and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return {"object": "lora_adapter", "lora_name": name, "model": served.model_id,
            "status": "loaded" if load else "unloaded", "workers": done}

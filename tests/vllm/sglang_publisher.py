"""SGLang's own KV event publisher, run in the peer virtualenv (sglang installed without its
dependencies, `make peer-venv`): its ZmqEventPublisher and msgspec structs from
sglang/srt/disaggregation/kv_events.py, publishing what a radix cache of page size 1 would.

The module's two imports that pull in SGLang's runtime (``sglang.srt.runtime_context``,
``sglang.srt.utils.network``: used by endpoint helpers, not by publishing) are stubbed; everything
that builds, encodes and sends the messages is SGLang's code.

    python sglang_publisher.py PUB_PORT REPLAY_PORT SCRIPT.json

SCRIPT.json: a list of steps, each {"store": [[hash, parent|null, token]...], "salt": str|null}
or {"remove": [hash, ...]} or {"clear": true}; one EventBatch per step. Prints "ready" once bound,
then "done" after the last batch, and waits for stdin to close.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types


def load_sglang_kv_events():
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed (make peer-venv)"
    root = spec.submodule_search_locations[0]
    for name, attrs in (("sglang.srt.runtime_context", {"get_parallel": lambda: None}),
                        ("sglang.srt.utils.network", {"NetworkAddress": object})):
        stub = types.ModuleType(name)
        stub.__dict__.update(attrs)
        sys.modules[name] = stub
    path = f"{root}/srt/disaggregation/kv_events.py"
    mod_spec = importlib.util.spec_from_file_location("sglang_kv_events", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def main() -> None:
    pub_port, replay_port = int(sys.argv[1]), int(sys.argv[2])
    with open(sys.argv[3]) as f:
        script = json.load(f)
    kv = load_sglang_kv_events()
    publisher = kv.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://*:{pub_port}",
                                     replay_endpoint=f"tcp://*:{replay_port}")
    print("ready", flush=True)
    sys.stdin.readline()  # the test's subscriber is connected
    for step in script:
        if "store" in step:
            events = [kv.BlockStored(block_hashes=[h], parent_block_hash=p, token_ids=[t], block_size=1,
                                     lora_id=None, medium="GPU", cache_salt=step.get("salt"))
                      for h, p, t in step["store"]]
        elif "remove" in step:
            events = [kv.BlockRemoved(block_hashes=list(step["remove"]), medium="GPU")]
        else:
            events = [kv.AllBlocksCleared()]
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=events))
    time.sleep(0.5)
    print("done", flush=True)
    sys.stdin.readline()
    publisher.shutdown()


if __name__ == "__main__":
    main()

"""`kvmesh admin`: inspect and manage the KV-cache index."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

from kvmesh.commands.common import add_security_args, apply_security

DEFAULT_KV = "127.0.0.1:50052"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin", help="query and manage the kv_service index",
                       description="Admin queries against a running kv_service.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kv-service", default=DEFAULT_KV, help=f"kv_service address (default {DEFAULT_KV})")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds (default 5)")
    add_security_args(common, serves=None, calls="admin")
    cmds = p.add_subparsers(dest="admin_command", metavar="ACTION")
    cmds.required = True
    cmds.add_parser("stats", parents=[common], help="index totals and models").set_defaults(func=stats)
    w = cmds.add_parser("workers", parents=[common], help="registered workers, their load and lease")
    w.add_argument("--all", action="store_true", help="include workers whose lease expired")
    w.set_defaults(func=workers)
    b = cmds.add_parser("block", parents=[common], help="who holds one block")
    b.add_argument("block_hash", help="the block hash in hex (32 characters)")
    b.set_defaults(func=block)
    prompt = argparse.ArgumentParser(add_help=False)
    src = prompt.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--text", help="text, tokenized with the model's tokenizer (--model, else found by its id)")
    prompt.add_argument("--model", help="model directory, or a model id found where `kvmesh up` keeps models "
                                        "(tokenizer and model id)")
    prompt.add_argument("--model-id", help="model id as the workers registered it (default: --model's directory "
                                           "name, else the one model the kv_service knows)")
    prompt.add_argument("--cache-salt", default="", help="tenant salt the prompt was sent with")
    lk = cmds.add_parser("lookup", parents=[common, prompt], help="which workers hold a prompt's prefix")
    lk.set_defaults(func=lookup)
    h = cmds.add_parser("hash", parents=[common, prompt],
                        help="a prompt's block hashes, as workers and routers compute them (for `admin block`)")
    h.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default: the model's, from the kv_service)")
    h.add_argument("--hash-algorithm", default=None, choices=["sha256_128", "xxh3_128"],
                   help="block hash (default: the model's, from the kv_service)")
    h.set_defaults(func=hash_prompt)
    cmds.add_parser("audit", parents=[common],
                    help="per worker: how the index's predicted cache hits compared with the engine's (the routers' "
                         "miss audit)").set_defaults(func=audit)
    f = cmds.add_parser("flush", parents=[common],
                        help="drop one worker's blocks from the index; the worker then resyncs (sends its cache)")
    f.add_argument("worker_id")
    f.set_defaults(func=flush)


def _client(args: argparse.Namespace):
    from kvmesh.kv_client.admin_client import AdminClient

    apply_security(args)
    return AdminClient(args.kv_service, args.timeout)


def _as_dict(message) -> dict:
    """A response as JSON-ready dict: field names as in the proto, every field, 64-bit ints as numbers,
    hash algorithms by their kvmesh names."""
    from google.protobuf import json_format

    from kvmesh.contract.convert import PB_TO_ALGO

    data = json_format.MessageToDict(message, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True, use_integers_for_enums=True,
                                     unquote_int64_if_possible=True)

    def names(node):
        if isinstance(node, dict):
            return {k: PB_TO_ALGO.get(v, "?") if k == "hash_algorithm" else names(v) for k, v in node.items()}
        if isinstance(node, list):
            return [names(v) for v in node]
        return node

    return names(data)


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _call(args: argparse.Namespace, fn) -> int:
    try:
        out = fn()
    except grpc.RpcError as err:
        print(f"kvmesh admin: {err.code().name}: {err.details()} (kv_service {args.kv_service})", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:
        print(f"kvmesh admin: {err}", file=sys.stderr)
        return 2
    data, text = out
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)
    return 0


def stats(args: argparse.Namespace) -> int:
    def go():
        data = _as_dict(_client(args).stats())
        models = data["models"]
        text = _table([[k, v] for k, v in data.items() if k != "models"], ["stat", "value"])
        if models:
            text += "\n\n" + _table([[m["model_id"], m["block_size"], m["hash_algorithm"], m["live_workers"]]
                                      for m in models], ["model", "block_size", "hash", "live_workers"])
        return data, text

    return _call(args, go)


def workers(args: argparse.Namespace) -> int:
    def go():
        r = _client(args).workers(include_expired=args.all)
        data = _as_dict(r)["workers"]
        # NOTE: blocks per tier: on the device (capacity: num_blocks) and in the host tier (capacity as
        # registered; - = none declared)
        rows = [[d["worker_id"], d.get("engine") or "kvmesh", d.get("role") or "both", d["address"], d["model_id"], d["blocks_indexed"],
                 d["num_blocks"], d.get("host_blocks_indexed", 0), d.get("host_blocks") or "-",
                 d["load"]["num_running"], d["load"]["num_waiting"],
                 d.get("pending", {}).get("requests", 0), d["lease_remaining_ms"], "yes" if d["live"] else "no"]
                for d in data]
        return data, _table(rows, ["worker", "engine", "role", "address", "model", "blocks", "capacity", "host_blocks",
                                   "host_capacity", "running", "waiting", "picked", "lease_ms", "live"])

    return _call(args, go)


def audit(args: argparse.Namespace) -> int:
    def go():
        audits = _client(args).audit()
        data = [{"worker_id": w, **{f: getattr(a, f) for f in a.__dataclass_fields__},
                 "silent_miss_rate": round(a.silent_misses / a.requests, 4) if a.requests else 0.0,
                 "unseen_hit_rate": round(a.unseen_hits / a.requests, 4) if a.requests else 0.0}
                for w, a in audits.items()]
        rows = [[d["worker_id"], d["engine"] or "-", d["requests"], d["predicted_hits"], d["cached_hits"],
                 f"{d['silent_miss_rate']:.3f}", f"{d['unseen_hit_rate']:.3f}", d["predicted_blocks"],
                 d["cached_blocks"]] for d in data]
        return data, _table(rows, ["worker", "engine", "requests", "predicted_hits", "actual_hits", "silent_miss_rate",
                                   "unseen_hit_rate", "predicted_blocks", "cached_blocks"])

    return _call(args, go)


def block(args: argparse.Namespace) -> int:
    def go():
        try:
            raw = bytes.fromhex(args.block_hash)
        except ValueError:
            raise ValueError(f"block hash must be hex, got {args.block_hash!r}") from None
        r = _client(args).block(raw)
        data = {"block_hash": args.block_hash, "refcount": r.refcount, "holders": list(r.holders),
                "host_holders": list(r.host_holders)}
        return data, _table([[args.block_hash, r.refcount, ",".join(r.holders) or "-", ",".join(r.host_holders) or "-"]],
                            ["block", "refcount", "holders", "host_holders"])

    return _call(args, go)


def _token_ids(args: argparse.Namespace, model_id: str | None = None) -> list[int]:
    if args.tokens is not None:
        try:
            return [int(t) for t in args.tokens.replace(" ", "").split(",") if t]
        except ValueError:
            raise ValueError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
    from kvmesh.contract.modelinfo import load_tokenizer

    return load_tokenizer(model_dir_for(args.model, model_id)).encode(args.text, add_special_tokens=True).ids


def model_dir_for(model: str | None, model_id: str | None) -> Path:
    """The directory whose tokenizer --text uses: ``--model`` when it is a directory; else the model
    (``--model`` as an id, or the id the kv_service reports) where `kvmesh up` and `make run` keep
    models (``$KVMESH_CACHE_DIR/models/<id>``, the demo model ``default`` among them)."""
    from kvmesh.make_model import cache_dir

    if model and Path(model).is_dir():
        return Path(model)
    name = model or model_id
    if not name:
        raise ValueError("--text needs the model's tokenizer: give --model DIR (the checkpoint the workers serve)")
    found = cache_dir() / "models" / name
    if (found / "tokenizer.json").is_file():
        return found
    raise ValueError(f"no tokenizer for model {name!r}: {found} has none; give --model DIR (the checkpoint "
                     "directory the workers serve) or --tokens")


def _models(args: argparse.Namespace) -> list[dict]:
    return _as_dict(_client(args).stats())["models"]


def _model_id(args: argparse.Namespace, models: list[dict] | None = None) -> str:
    """--model-id, else --model's directory name, else the one model the kv_service knows."""
    from kvmesh.contract.modelinfo import model_id_for

    if args.model_id:
        return args.model_id
    if args.model:
        # NOTE: a directory names its model; anything else is taken as the model id itself.
        return model_id_for(args.model) if Path(args.model).is_dir() else args.model
    models = _models(args) if models is None else models
    if len(models) != 1:
        known = ", ".join(m["model_id"] for m in models) or "none"
        raise ValueError(f"the kv_service serves {len(models)} models ({known}): name one with --model-id or --model")
    return models[0]["model_id"]


def lookup(args: argparse.Namespace) -> int:
    def go():
        models = _models(args)
        model_id = _model_id(args, models)
        ids = _token_ids(args, model_id)
        spec = next((m for m in models if m["model_id"] == model_id), None)
        if spec is None:
            return {"model_id": model_id, "num_tokens": len(ids), "block_size": 0, "num_blocks_queried": 0,
                    "workers": []}, f"no live worker serves model {model_id!r}"
        if len(ids) < spec["block_size"]:
            # NOTE: no full block, so nothing to look up: 0 blocks, as `admin hash` says.
            return ({"model_id": model_id, "num_tokens": len(ids), "block_size": spec["block_size"],
                     "num_blocks_queried": 0, "workers": []},
                    f"{len(ids)} tokens, 0 full blocks of {spec['block_size']}: a prompt shorter than a block "
                    "is never cached")
        r = _client(args).lookup_tokens(model_id, ids, args.cache_salt)
        data = {"model_id": model_id, "num_tokens": len(ids)} | _as_dict(r)
        for w in data["workers"]:
            w["matched_tokens"] = w["matched_blocks"] * r.block_size
        rows = [[w["worker_id"], w["address"], w["matched_blocks"], w["matched_tokens"], w["host_blocks"],
                 w["load"]["num_running"], w["load"]["num_waiting"]] for w in data["workers"]]
        if not r.block_size:
            return data, f"no live worker serves model {model_id!r}"
        text = f"{len(ids)} tokens, {r.num_blocks_queried} full blocks of {r.block_size}\n"
        return data, text + _table(rows, ["worker", "address", "blocks", "tokens", "host_blocks", "running", "waiting"])

    return _call(args, go)


def hash_prompt(args: argparse.Namespace) -> int:
    from kvmesh.contract.block_hash import BlockHasher

    def go():
        models = None if args.block_size and args.hash_algorithm and (args.model or args.model_id) else _models(args)
        model_id = _model_id(args, models)
        spec = next((m for m in models or [] if m["model_id"] == model_id), {})
        block_size = args.block_size or spec.get("block_size")
        algorithm = args.hash_algorithm or spec.get("hash_algorithm")
        if not (block_size and algorithm):
            raise ValueError(f"no live worker serves model {model_id!r}: give --block-size and --hash-algorithm")
        ids = _token_ids(args, model_id)
        hashes = [h.hex() for h in BlockHasher(model_id, block_size, algorithm).hash_prompt(ids, args.cache_salt)]
        data = {"model_id": model_id, "block_size": block_size, "hash_algorithm": algorithm, "num_tokens": len(ids),
                "block_hashes": hashes}
        head = f"{len(ids)} tokens, {len(hashes)} full blocks of {block_size} ({model_id}, {algorithm})\n"
        return data, head + _table([[i, h] for i, h in enumerate(hashes)], ["block", "hash"])

    return _call(args, go)


def flush(args: argparse.Namespace) -> int:
    def go():
        r = _client(args).flush(args.worker_id)
        return {"worker_id": args.worker_id} | _as_dict(r), (
            f"removed {r.blocks_removed} blocks of {args.worker_id} from the index; the worker is asked to "
            "resync: its next heartbeat makes it send a snapshot of its cache")

    return _call(args, go)

"""`kvmesh generate`: send one prompt to the router and stream the answer."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from kvmesh.commands.common import add_security_args, apply_security


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="send a prompt to the router and stream the completion",
                       description="Send one prompt through the router; text streams to stdout.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--router", default="127.0.0.1:50051", help="router host:port, or several routers spread by gRPC's round_robin: 'ipv4:127.0.0.1:50051,127.0.0.1:50053' or 'h1:p1,h2:p2' (default 127.0.0.1:50051)")
    p.add_argument("--model", default="", metavar="ID",
                   help="the model to run, as `GET /v1/models` or ListModels names it (default: the router's default)")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as one user message through the model's chat template")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string, repeatable: the text ends before the first one")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--cache-salt", default="", help="tenant salt: requests with other salts never share cache")
    p.add_argument("--timeout", type=float, default=600.0, help="request deadline in seconds (default 600)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object at the end instead of streaming text")
    add_security_args(p, serves=None, calls="api")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.client import Client

    try:
        apply_security(args)
    except (ValueError, OSError) as exc:
        print(f"kvmesh generate: {exc}", file=sys.stderr)
        return 2
    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, ignore_eos=args.ignore_eos, cache_salt=args.cache_salt, model=args.model,
                  stop=args.stop)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    try:
        with Client(args.router, args.timeout) as client:
            if args.json:
                print(json.dumps(client.generate(prompt, **kwargs).to_dict()))
                return 0
            last, rid = None, ""
            for msg in client.stream(prompt, **kwargs):
                rid = rid or msg.request_id
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                last = msg
            u = last.usage if last is not None else None
            if u is not None:
                print(f"\n[request_id={rid} served_by={last.served_by} prompt_tokens={u.prompt_tokens} "
                      f"cached_tokens={u.cached_tokens} completion_tokens={u.completion_tokens}]", file=sys.stderr)
            return 0
    except grpc.RpcError as err:
        print(f"kvmesh generate: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1

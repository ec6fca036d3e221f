"""``kvmesh make-model DIR``: write a small random Llama / Qwen2 / Mistral checkpoint."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvmesh.make_model import ARCHS, ModelSpec

    d = ModelSpec()
    p = subparsers.add_parser(
        "make-model",
        help="write a small random checkpoint + BPE tokenizer",
        description="Writes config.json, model.safetensors, generation_config.json and tokenizer.json "
        "(byte-level BPE trained on a shipped English text) to DIR.",
    )
    p.add_argument("dir", metavar="DIR", help="output directory")
    p.add_argument("--arch", choices=ARCHS, default=d.arch)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's vocabulary")
    p.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings)
    p.add_argument("--sliding-window", type=int, default=None,
                   help="mistral: every layer; qwen2: the layers from --max-window-layers on")
    p.add_argument("--max-window-layers", type=int, default=None,
                   help="qwen2 with --sliding-window: layers before this index keep full attention "
                   "(default: half the layers)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--init-std", type=float, default=d.init_std, help="std of the normal weight init")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.make_model import ModelSpec, make_model

    spec = ModelSpec(
        arch=args.arch,
        layers=args.layers,
        hidden_size=args.hidden_size,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        sliding_window=args.sliding_window,
        max_window_layers=args.max_window_layers,
        seed=args.seed,
        init_std=args.init_std,
    )
    try:
        out = make_model(args.dir, spec)
    except ValueError as exc:
        print(f"kvmesh make-model: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0

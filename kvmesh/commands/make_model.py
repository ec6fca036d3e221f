"""``kvmesh make-model DIR``: write a small random Llama / Qwen2 / Qwen3 / Mistral checkpoint."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvmesh.commands.config_args import add_config_args
    from kvmesh.make_model import ARCHS, ModelSpec

    p = subparsers.add_parser(
        "make-model",
        help="write a small random checkpoint + BPE tokenizer",
        description="Writes config.json, model.safetensors, generation_config.json and tokenizer.json "
        "(byte-level BPE trained on a shipped English text) to DIR.",
    )
    p.add_argument("dir", metavar="DIR", help="output directory")
    add_config_args(p, ModelSpec, exclude=("extra_config",), choices={"arch": ARCHS})
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.config_args import config_from_args
    from kvmesh.make_model import ModelSpec, make_model

    spec = config_from_args(ModelSpec, args, exclude=("extra_config",))
    try:
        out = make_model(args.dir, spec)
    except ValueError as exc:
        print(f"kvmesh make-model: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0

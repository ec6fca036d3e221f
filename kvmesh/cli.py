"""The ``kvmesh`` command: one subcommand per module in kvmesh/commands/."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# Each module defines ``register(subparsers)``, which adds its subcommand(s) and sets
# ``func(args) -> int`` as the handler. Imported lazily so `kvmesh admin` never imports torch.
COMMAND_MODULES: dict[str, str] = {
    "kv-service": "kvmesh.commands.kv_service",
    "admin": "kvmesh.commands.admin",
    "make-model": "kvmesh.commands.make_model",
    "offline": "kvmesh.commands.offline",
    "router": "kvmesh.commands.router",
    "epp": "kvmesh.commands.epp",
    "worker": "kvmesh.commands.worker",
    "generate": "kvmesh.commands.generate",
    "up": "kvmesh.commands.up",
    "bench": "kvmesh.commands.bench",
    "simulate": "kvmesh.commands.simulate",
    "bridge": "kvmesh.commands.bridge",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="KV-cache-aware LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in COMMAND_MODULES.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"(run `kvmesh {name} --help`)", add_help=False)
            continue
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMAND_MODULES else None)
    args = parser.parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # NOTE: the reader left (`kvmesh admin stats | head -1`): no traceback, and no second
        # complaint when Python flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code


if __name__ == "__main__":
    sys.exit(main())

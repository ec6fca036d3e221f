"""``kvmesh offline``: batch generation from a JSONL file to a JSONL file, in input order.

Every input line is checked before any generation starts; a bad line stops the run with exit
code 2 and ``FILE:LINE: message`` on stderr, and no output is written (docs/engine.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kvmesh.commands.worker import add_engine_args

_PARAM_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
_KEYS = {"prompt", "prompt_token_ids", *_PARAM_KEYS}
_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "max_tokens": ("an integer", (int,)),
    "temperature": ("a number", (int, float)),
    "top_p": ("a number", (int, float)),
    "top_k": ("an integer", (int,)),
    "seed": ("an integer or null", (int,)),
    "stop_token_ids": ("a list of integers", (list,)),
    "ignore_eos": ("true or false", (bool,)),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "offline",
        help="generate for every line of a JSONL file",
        description="Reads {prompt|prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, "
        "stop_token_ids, ignore_eos} per line; writes {token_ids, text, finish_reason, cached_tokens} "
        "per line in the same order.",
    )
    p.add_argument("--model", default=None, help="model directory (default: the kvmesh default model)")
    p.add_argument("--input", required=True, help="input JSONL")
    p.add_argument("--output", required=True, help="output JSONL")
    add_engine_args(p)
    p.set_defaults(func=run)


def parse_line(text: str, where: str) -> tuple[list[int] | str, Any]:
    """One input line -> (prompt, SamplingParams); raises ValueError prefixed with ``where``."""
    from kvmesh.contract.types import SamplingParams

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(_KEYS)}")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_token_ids'")
    prompt = obj.get("prompt", obj.get("prompt_token_ids"))
    if "prompt" in obj and not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    if "prompt_token_ids" in obj and not isinstance(prompt, list):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a list of integers")
    kwargs = {k: obj[k] for k in _PARAM_KEYS if k in obj and obj[k] is not None}
    for key, value in kwargs.items():
        kind, types = _TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ValueError(f"{where}: '{key}' must be {kind}, got {value!r}")
    params = SamplingParams(**kwargs)
    try:
        params.validate()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return prompt, params


def run(args: argparse.Namespace) -> int:
    from kvmesh.commands.config_args import config_from_args
    from kvmesh.make_model import ensure_default_model
    from kvmesh.model_worker.config import EngineConfig
    from kvmesh.model_worker.engine.llm import LLM

    try:
        with open(args.input, encoding="utf-8") as f:
            lines = [(i, line) for i, line in enumerate(f, start=1) if line.strip()]
        parsed = [parse_line(line, f"{args.input}:{i}") for i, line in lines]
        config = config_from_args(EngineConfig, args, model=str(args.model or ensure_default_model()))
        llm = LLM(config.model, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                   if f.name != "model"})
        prompts = []
        for (i, _), (prompt, _params) in zip(lines, parsed, strict=True):
            try:
                ids = llm.encode(prompt) if isinstance(prompt, str) else prompt
                llm.engine.check_prompt(ids)
            except ValueError as exc:
                raise ValueError(f"{args.input}:{i}: {exc}") from None
            prompts.append(ids)
    except (OSError, ValueError) as exc:
        print(f"kvmesh offline: error: {exc}", file=sys.stderr)
        return 2
    outputs = llm.generate(prompts, [p for _, p in parsed])
    with open(args.output, "w", encoding="utf-8") as f:
        for out in outputs:
            record = {
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "cached_tokens": out.cached_tokens,
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(outputs)} results to {args.output}", file=sys.stderr)
    return 0

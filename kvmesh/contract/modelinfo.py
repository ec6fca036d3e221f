"""What every part needs to know about a checkpoint directory without importing torch."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def model_id_for(model_dir: str | Path, override: str | None = None) -> str:
    """The model's identity in block hashes and the index.

    The checkpoint directory's name (e.g. ``Llama-3.1-8B-Instruct``) unless ``override`` is given:
    it is the same on every host that mounts the model, wherever the mount point is.
    """
    if override:
        return override
    return Path(model_dir).resolve().name


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs tokenizer.json")
    return Tokenizer.from_file(str(path))


def vocab_size(model_dir: str | Path) -> int | None:
    """``vocab_size`` of the model's config.json (``text_config``'s of a multimodal one), or None."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for cfg in (config, config.get("text_config") or {}):
        value = cfg.get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    return None


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a transformers config.json states the model's context length (first found wins)."""


def context_length(model_dir: str | Path) -> int | None:
    """The model's context length from its config.json (``text_config`` of a multimodal one), or
    None when the directory has no config or the config states none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for cfg in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None

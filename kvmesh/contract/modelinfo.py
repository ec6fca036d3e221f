"""What every part needs to know about a checkpoint directory without importing torch."""

from __future__ import annotations

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

"""Builds a model from a Hugging Face directory: config.json + (sharded) safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.execution.models import model_class


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's shard files: those named by model.safetensors.index.json, else every *.safetensors."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} has no *.safetensors weights (pytorch .bin checkpoints are not supported)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"safetensors shards listed in the index are missing: {missing[:3]}")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(name, tensor)`` for every tensor of every shard, one shard open at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str) -> nn.Module:
    """Instantiates ``cfg.architecture`` on ``device`` in ``dtype`` and loads its weights."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(iter_weights(model_dir))
    # NOTE: inference only: no parameter needs a gradient (nor a compiled graph a backward pass).
    return model.requires_grad_(False).eval()

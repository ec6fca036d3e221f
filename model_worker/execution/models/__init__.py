"""Model implementations, looked up by the ``architectures`` entry of config.json."""

from __future__ import annotations

from torch import nn

from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.execution.models.llama import LlamaForCausalLM

# NOTE: Qwen2, Qwen3 and Mistral are Llama with config flags (qkv bias / tied head, q/k norm, sliding window).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The implementation of ``cfg.architecture``."""
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}") from None

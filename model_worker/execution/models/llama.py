"""The Llama family on packed ragged batches: Llama (incl. llama3 rope), Qwen2 (qkv bias, tied
embeddings), Qwen3 (per-head RMSNorm of queries and keys), Mistral (sliding window). The differences
are config flags, not classes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.execution.models.attention import PagedAttention
from kvmesh.model_worker.execution.models.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.attn = PagedAttention(layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer])
        self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # NOTE: q and k sit side by side in the fused projection: one rotary pass over both heads.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: each head normed over head_dim with its own weights, before rotary (as transformers).
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads])[0], self.k_norm(qk[:, self.num_heads :])[0]), dim=1)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama-family model; ``forward`` returns hidden states, ``compute_logits`` logits."""

    # checkpoint name fragment -> (our fused parameter fragment, shard index)
    _STACKED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def kv_group_of_layer(self) -> list[int]:
        """Per layer: its KV cache group, whose metadata (block tables, slots) it reads; bound by
        the runner with the caches."""
        return [attn.kv_group for attn in self.kv_caches()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, hidden]``.

        Called inside the runner's forward context (forward_context.py): the attention metadata.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        return self.lm_head(hidden).float()

    def kv_caches(self) -> list[PagedAttention]:
        """The attention modules whose caches the runner binds, in layer order."""
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (HF names) into the fused parameters, casting dtype.

        Raises:
            ValueError: a parameter is missing from the checkpoint or has the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            shard = None
            for ckpt, (ours, idx) in self._STACKED.items():
                if f".{ckpt}." in name:
                    name, shard = name.replace(ckpt, ours), idx
                    break
            param = params.get(name)
            if param is None:
                if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
            target = param.data if shard is None else self._shard(name, param.data, shard)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        missing = [n for n in self._expected_names(params) if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _shard(self, name: str, data: torch.Tensor, idx: int) -> torch.Tensor:
        if "qkv_proj" in name:
            q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
            sizes = [q, kv, kv]
        else:
            sizes = [self.cfg.intermediate_size] * 2
        return data.split(sizes, dim=0)[idx]

    def _expected_names(self, params: dict[str, nn.Parameter]) -> list[str]:
        names = []
        for name in params:
            if "qkv_proj" in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif "gate_up_proj" in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(name)
        return names

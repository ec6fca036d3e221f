"""Building blocks of the Llama family: Linear, RMSNorm, rotary embedding (default + llama3), SwiGLU.

Written for the CPU as much as for the GPU: each op makes as few passes over the activations and
as few temporaries as it can (docs/engine.md, "CPU profile").
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_MIN_ROWS = 128
"""Products with fewer rows stay on the default BLAS: oneDNN wins on prefill-sized inputs only."""


def _onednn_linear_available() -> bool:
    try:
        x, w = torch.ones(2, 4, device="cpu"), torch.ones(3, 4, device="cpu")
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (AttributeError, RuntimeError, TypeError):
        return False
    return bool(torch.equal(out, F.linear(x, w)))


_ONEDNN_LINEAR = _onednn_linear_available()
"""Decided once at import: a constant to ``torch.compile`` (which cannot trace the probe)."""


@torch.library.custom_op("kvmesh::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product as an opaque op: under ``torch.compile`` inductor keeps it (it has no lowering
    of the op with an unpacked weight, and its own product is MKL's, ~1.2x slower at prefill sizes)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 CPU products of many rows run on oneDNN.

    torch's CPU ``F.linear`` calls MKL's sgemm, which on this project's AMD hosts reaches ~60-90
    GFLOP/s at prefill shapes where oneDNN (the library vLLM's CPU build uses for the same layers)
    reaches ~80-105; the same product, rounded differently in the last bits. Decode-sized inputs
    (few rows) are as fast or faster on MKL and keep it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the row count is tested last: under torch.compile it is the one test that guards on
        # the (dynamic) token count, and only on CPU.
        if (
            _ONEDNN_LINEAR
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] >= _ONEDNN_MIN_ROWS
        ):
            if torch.compiler.is_compiling():
                return torch.ops.kvmesh.onednn_linear(x, self.weight, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back before the weight (as HF does).

    float32 activations take torch's fused ``rms_norm`` (one pass instead of five).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``; the sum is the next residual."""
        if residual is not None:
            x = x + residual
        residual = x
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps), residual
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim/2]`` (float32), with llama3 long-context scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding; ``cos_sin(positions)`` is computed once per forward.

    NOTE: rotate-half angles repeat across the two halves of a head, so only one half is kept.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` of shape ``[T, 1, head_dim / 2]`` for broadcasting over heads."""
        freqs = (positions.float()[:, None] * self.inv_freq[None, :])[:, None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]`` rotated by the per-token angles (``cos``/``sin`` ``[T, 1, D/2]``).

    ``x * cos + rotate_half(x) * sin`` per half: ``(x1 cos - x2 sin, x2 cos + x1 sin)``, written
    into one output without the rotated copy.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():
        # NOTE: inductor fuses this into one kernel; dynamo cannot trace ``out=`` into a view.
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
    return out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))

"""LoRA adapters on the Llama family: PEFT adapters read and checked, and the projections that run them.

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``, what
``save_pretrained`` writes) with LoRA on the attention (q/k/v/o) and MLP (gate/up/down) projections.
With ``--enable-lora`` every such projection of the model becomes a :class:`LoRALinear`: the base
layer plus ``--max-loras`` fixed *slots* of stacked adapter weights, ``A`` ``[max_loras, S*R, in]``
and ``B`` ``[max_loras, out, S*R]`` (``R`` = ``--max-lora-rank``, ``S`` the projections fused in
it: 3 for qkv, 2 for gate/up, each slice's A rows and B columns its own block, so a fused layer is
one LoRA of rank ``S*R``). Each token names its slot in the forward context (-1 = base model), and
``kernels.add_lora`` adds ``scale * B(A(x))`` per token. The slots never move or resize, so the
compiled forward and the CUDA graphs see the same tensors whatever adapters they hold.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kvmesh.kernels import add_lora
from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.execution.forward_context import current_forward_context

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt (peft's names)."""

# Our (fused) projection -> the peft modules in it, in the order of its output slices.
_FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# peft options that change what the adapter computes, and the value that means "off".
_UNSUPPORTED = {
    "use_dora": (False, "DoRA (use_dora) is not supported"),
    "modules_to_save": (None, "modules_to_save (fully trained extra modules) is not supported"),
    "layers_to_transform": (None, "layers_to_transform is not supported: adapt every layer"),
    "layer_replication": (None, "layer_replication is not supported"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern) are not supported"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern) are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D models) is not supported"),
    "lora_bias": (False, "a LoRA bias (lora_bias) is not supported"),
    "target_parameters": (None, "target_parameters is not supported"),
    "trainable_token_indices": (None, "trainable_token_indices is not supported"),
}


def _module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """peft module name -> (in_features, out_features) in this model."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter's weights on the host: per (layer, peft module) its ``A`` ``[r, in]`` and ``B`` ``[out, r]``."""

    name: str
    path: str
    rank: int
    scale: float
    """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (peft's ``scaling``)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Reads and checks a PEFT LoRA adapter for a model of ``cfg``.

    Raises:
        ValueError: naming what is missing or unsupported (files, peft options, modules, ranks, shapes).
    """
    from safetensors.torch import load_file

    d = Path(path)
    config_file, weights_file = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {d} needs adapter_config.json and adapter_model.safetensors "
                         "(what peft's save_pretrained writes)")
    try:
        conf = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA adapter {name!r}: {config_file} is not JSON: {exc}") from None
    where = f"LoRA adapter {name!r} ({d})"
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {conf.get('peft_type')!r}; only LORA adapters are supported")
    if conf.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={conf['bias']!r} is not supported; only bias='none'")
    for key, (off, why) in _UNSUPPORTED.items():
        if conf.get(key, off) not in (off, None, False, {}, []):
            raise ValueError(f"{where}: {why}")
    rank = conf.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}; raise --max-lora-rank")
    alpha = conf.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = conf.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(TARGET_MODULES))
        if bad:
            raise ValueError(f"{where}: target_modules {bad} are not supported; LoRA applies to "
                             f"{', '.join(TARGET_MODULES)}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    shapes = _module_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        m = _TENSOR.search(key)
        if m is None or m.group(2) not in shapes:
            raise ValueError(f"{where}: tensor {key!r} has no place: LoRA applies to the projections "
                             f"{', '.join(TARGET_MODULES)} of the decoder layers only")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}; the model has {cfg.num_layers}")
        d_in, d_out = shapes[module]
        want = (rank, d_in) if ab == "A" else (d_out, rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{where}: {key} has shape {tuple(tensor.shape)}, expected {want} (r={rank}); "
                             "is it an adapter of this model?")
        parts.setdefault((layer, module), {})[ab] = tensor.float().contiguous()
    if not parts:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for k, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {k[0]} {k[1]} has lora_{''.join(ab)} without its pair")
        weights[k] = (ab["A"], ab["B"])
    return LoRAAdapter(name=name, path=str(d), rank=rank, scale=float(scale), weights=weights)


class LoRALinear(nn.Module):
    """A projection plus ``max_loras`` adapter slots; each token adds its slot's delta (none at -1).

    Args:
        base: the model's projection (its weights unchanged).
        slices: the output width of each peft module fused in it, in order.
        max_loras: slots.
        max_rank: rank per slice (smaller adapters are zero-padded).
        scales: ``[max_loras]`` float32, shared by every LoRALinear of the model.
    """

    def __init__(self, base: nn.Linear, slices: list[int], max_loras: int, max_rank: int, scales: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.max_rank = max_rank
        w = base.weight
        total = len(slices) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, total, w.shape[1], dtype=w.dtype, device=w.device))
        self.register_buffer("lora_b", torch.zeros(max_loras, w.shape[0], total, dtype=w.dtype, device=w.device))
        self.register_buffer("scales", scales)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's ``(A, B)`` per slice (None = not adapted) into ``slot``."""
        a, b, r_max = self.lora_a[slot], self.lora_b[slot], self.max_rank
        a.zero_()
        b.zero_()
        offset = 0
        for i, (width, part) in enumerate(zip(self.slices, parts, strict=True)):
            if part is not None:
                pa, pb = part
                r = pa.shape[0]
                a[i * r_max : i * r_max + r].copy_(pa)
                b[offset : offset + width, i * r_max : i * r_max + r].copy_(pb)
            offset += width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():
            return y + torch.ops.kvmesh.lora_delta(x, self.lora_a, self.lora_b, self.scales)
        lora = current_forward_context().lora
        if lora is not None:
            add_lora(y, x, self.lora_a, self.lora_b, self.scales, lora.token_slots, lora.groups)
        return y


@torch.library.custom_op("kvmesh::lora_delta", mutates_args=())
def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The LoRA delta ``[T, out]`` of each token under its slot of the current forward context, as an
    opaque op under ``torch.compile`` (the slots a batch uses are data, which inductor must not trace)."""
    y = x.new_zeros((x.shape[0], lora_b.shape[1]))
    lora = current_forward_context().lora
    if lora is not None:
        add_lora(y, x, lora_a, lora_b, scales, lora.token_slots, lora.groups)
    return y


@lora_delta.register_fake
def _(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], lora_b.shape[1]))


class LoRALayers:
    """Every projection of a Llama-family model wrapped in a :class:`LoRALinear` (in place), and the
    slot writes: what an adapter manager (execution/lora_manager.py) puts in or takes out of a slot.

    Args:
        model: a loaded LlamaForCausalLM (its weights are not touched).
        cfg: its config.
        max_loras: slots.
        max_rank: the largest adapter rank a slot holds.
    """

    def __init__(self, model: nn.Module, cfg: ModelConfig, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = _module_shapes(cfg)
        device = next(model.parameters()).device
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.layers: list[tuple[int, tuple[str, ...], LoRALinear]] = []
        layers = model.layers  # type: ignore[attr-defined]
        for i, layer in enumerate(layers):
            for path, modules in _FUSED.items():
                parent_name, attr = path.split(".")
                parent = getattr(layer, parent_name)
                wrapped = LoRALinear(getattr(parent, attr), [shapes[m][1] for m in modules], max_loras,
                                     max_rank, self.scales)
                setattr(parent, attr, wrapped)
                self.layers.append((i, modules, wrapped))

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts ``adapter`` in ``slot`` (whatever was there goes)."""
        for layer, modules, wrapped in self.layers:
            wrapped.set_slot(slot, [adapter.weights.get((layer, m)) for m in modules])
        self.scales[slot] = adapter.scale

    def clear(self, slot: int) -> None:
        for _, modules, wrapped in self.layers:
            wrapped.set_slot(slot, [None] * len(modules))
        self.scales[slot] = 0.0

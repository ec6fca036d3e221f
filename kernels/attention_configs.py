"""The Triton attention's launch configs: one committed table, chosen per head shape, phase and dtype.

A launch is four numbers (:class:`AttentionConfig`) per key (head dim, query heads per KV head,
phase, dtype); the phase is ``decode`` for decode-heavy batches (mean query length <= 2) and
``prefill`` otherwise. ``attention_configs.json`` beside this module holds them with the split-KV
policy. ``benchmarks/kernel_bench.py --sweep --write-table`` writes it: on a GPU the measured
winners of its sweep, marked with the device and date; on a machine without one the defaults
below, marked as never tuned. A key the table lacks takes :func:`default_attention_config`.

This module imports neither triton nor a GPU library: the worker checks a model's head shape
(:func:`check_head_shape`) and the benchmarks read the table on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TABLE_PATH = Path(__file__).with_name("attention_configs.json")

MAX_HEAD_DIM = 256
"""The largest head dim the kernel runs: a prefill tile of 64 rows x 256 dims fills the registers
(docs/kernels.md, "Head shapes")."""
MAX_GROUP = 64
"""Query heads per KV head at most: a tile packs a KV head's whole group, so a larger group's
decode tile would be wider than any launch config's rows."""

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

SERVED_HEAD_SHAPES: tuple[tuple[int, int, int], ...] = (
    (32, 8, 64),  # Llama-3.2-1B
    (32, 8, 128),  # Llama-3.1-8B, Mistral-7B, Qwen3-4B, Qwen3-8B
    (14, 2, 64),  # Qwen2.5-0.5B
    (28, 4, 128),  # Qwen2.5-7B
    (16, 8, 128),  # Qwen3-0.6B, Qwen3-1.7B (head dim 128 over hidden sizes of 1024 and 2048)
    (32, 32, 128),  # no GQA
)
"""(query heads, KV heads, head dim) of the model families kvmesh serves: what the kernel tests,
``kernel_bench.py`` and ``make gpu-check`` run."""


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """The launch of one kind of batch: tile sizes and pipelining (docs/kernels.md, "Launch configs")."""

    block_m: int
    """Rows of a program's tile: query tokens x the GQA group, padded once to a power of two
    (at least the group; at least 16 for tl.dot)."""
    block_n: int
    """Keys per inner-loop tile."""
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True, slots=True)
class SplitKVPolicy:
    """When a decode-heavy batch splits each program's keys (docs/kernels.md, "Split-KV")."""

    max_splits: int = 16
    min_tiles_per_split: int = 4
    """Key tiles each split keeps at least (of the block table's width: the longest context)."""
    programs_per_sm: int = 1
    """Split while the grid has fewer programs than this many per SM."""


ConfigKey = tuple[int, int, str, str]
"""(head dim, query heads per KV head, "decode" | "prefill", "bf16" | "fp16" | "fp32")."""


def phase_name(decode_heavy: bool) -> str:
    return "decode" if decode_heavy else "prefill"


def default_attention_config(decode_heavy: bool, dtype: torch.dtype, head_dim_pad: int) -> AttentionConfig:
    """The untuned starting point, for every head shape: a decode tile is one token's head group
    (tl.dot needs 16 rows), a prefill tile 64 rows; 64 keys a tile (32 for D > 128), half for
    float32. On an H100 0.64-0.89x of SDPA for 32/8 x 128 (docs/kernels.md, "Tuning")."""
    block_n = 64 if head_dim_pad <= 128 else 32
    if dtype == torch.float32:
        block_n //= 2  # twice the bytes per element: keep K/V tiles in shared memory
    return AttentionConfig(block_m=16 if decode_heavy else 64, block_n=block_n)


@dataclass(frozen=True, slots=True)
class ConfigTable:
    """The committed table: configs by key, the split policy, and where they came from."""

    configs: dict[ConfigKey, AttentionConfig]
    split_kv: SplitKVPolicy
    tuned_on: dict[ConfigKey, str]
    """Per key, the device and date of the sweep that chose it; a key absent here holds a default."""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        rows = []
        for key in sorted(self.configs):
            head_dim, group, phase, dtype = key
            rows.append({"head_dim": head_dim, "group": group, "phase": phase, "dtype": dtype,
                         **dataclasses.asdict(self.configs[key]), "tuned_on": self.tuned_on.get(key)})
        return {"note": self.note, "split_kv": dataclasses.asdict(self.split_kv), "configs": rows}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConfigTable:
        configs: dict[ConfigKey, AttentionConfig] = {}
        tuned: dict[ConfigKey, str] = {}
        fields = [f.name for f in dataclasses.fields(AttentionConfig)]
        for row in data.get("configs", []):
            key = (int(row["head_dim"]), int(row["group"]), str(row["phase"]), str(row["dtype"]))
            if key[2] not in ("decode", "prefill") or key[3] not in DTYPE_NAMES.values():
                raise ValueError(f"{TABLE_PATH.name}: bad key {key}")
            configs[key] = AttentionConfig(**{f: int(row[f]) for f in fields if f in row})
            if row.get("tuned_on"):
                tuned[key] = str(row["tuned_on"])
        return cls(configs, SplitKVPolicy(**data.get("split_kv", {})), tuned, str(data.get("note", "")))


def defaults_table(shapes=SERVED_HEAD_SHAPES, dtypes=("bf16", "fp16", "fp32")) -> ConfigTable:
    """The table a machine without a GPU writes: every served shape's default, untuned."""
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    configs = {}
    for hq, hkv, d in shapes:
        for decode in (True, False):
            for dt in dtypes:
                configs[(d, hq // hkv, phase_name(decode), dt)] = default_attention_config(
                    decode, by_name[dt], head_dim_pad(d))
    return ConfigTable(configs, SplitKVPolicy(), {},
                       note="defaults: never tuned on a GPU (written without CUDA by kernel_bench.py "
                            "--write-table); a GPU's `kernel_bench.py --sweep --write-table` replaces them")


@functools.lru_cache(maxsize=1)
def load_table(path: str = str(TABLE_PATH)) -> ConfigTable:
    """The committed table (parsed once); the defaults when the file is absent."""
    p = Path(path)
    if not p.is_file():
        return ConfigTable({}, SplitKVPolicy(), {}, note=f"{p.name} absent: defaults")
    return ConfigTable.from_json(json.loads(p.read_text()))


def head_dim_pad(head_dim: int) -> int:
    """The kernel's padded head dim: a power of two, at least 16 (tl.dot's K)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def attention_config(decode_heavy: bool, dtype: torch.dtype, head_dim: int, group: int,
                     table: ConfigTable | None = None) -> AttentionConfig:
    """The launch for a batch: the table's entry for (head dim, group, phase, dtype), else the default."""
    key = (head_dim, group, phase_name(decode_heavy), DTYPE_NAMES.get(dtype, str(dtype)))
    config = (table or load_table()).configs.get(key)
    return config if config is not None else default_attention_config(decode_heavy, dtype, head_dim_pad(head_dim))


def split_kv_policy(table: ConfigTable | None = None) -> SplitKVPolicy:
    return (table or load_table()).split_kv


def check_head_shape(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Raises ValueError naming what the Triton attention cannot run (a worker refuses at start)."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads: "
                         "no GQA grouping serves that")
    problems = []
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        problems.append(f"head dim {head_dim} (it runs 1-{MAX_HEAD_DIM})")
    group = num_q_heads // num_kv_heads
    if group > MAX_GROUP:
        problems.append(f"{group} query heads per KV head (it runs at most {MAX_GROUP})")
    if problems:
        raise ValueError(
            f"the Triton attention kernel cannot run this model's heads ({num_q_heads} query / {num_kv_heads} KV "
            f"x {head_dim}): {' and '.join(problems)}; serve it with KVMESH_ATTENTION_BACKEND=torch "
            "(slower, no CUDA graphs) or pick a model with a supported head shape (docs/kernels.md, \"Head shapes\")")


__all__ = [
    "MAX_GROUP",
    "MAX_HEAD_DIM",
    "SERVED_HEAD_SHAPES",
    "TABLE_PATH",
    "AttentionConfig",
    "ConfigTable",
    "SplitKVPolicy",
    "attention_config",
    "check_head_shape",
    "default_attention_config",
    "defaults_table",
    "head_dim_pad",
    "load_table",
    "split_kv_policy",
]

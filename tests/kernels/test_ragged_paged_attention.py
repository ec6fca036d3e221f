"""Triton ragged paged attention vs the torch reference.

Without CUDA the kernel runs under the Triton interpreter on CPU (fp32, fp16, small shapes); with
CUDA the same scenarios run compiled on the GPU, plus bf16 and int32-overflow-sized caches.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch

from kvmesh import kernels
from kvmesh.kernels import attention_configs
from kvmesh.kernels.reference import ragged_paged_attention_ref
from tests.support.kernels import import_kernel_module

HAS_CUDA = torch.cuda.is_available()


triton_attention = import_kernel_module("kvmesh.kernels.triton_attention", "_ragged_paged_attention_kernel")


pytestmark = pytest.mark.usefixtures("interpreter_env")


NEEDS_GPU = "needs an NVIDIA GPU with CUDA"
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only where CUDA is absent"),
        id="interpreter",
    ),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_GPU)]),
]
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_GPU)]

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_q_lens: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.cu_q_lens, self.kv_lens, self.block_tables


def make_batch(
    lens: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_blocks: int = 5,
    q_from_fused_qkv: bool = False,
) -> Batch:
    """A batch of (q_len, kv_len) sequences over a cache with shuffled physical blocks.

    Cache slots no sequence owns (spare blocks, the tail of each last block) hold NaN, and table
    entries past a sequence's last block point at a NaN block: a kernel that reads one of them
    (instead of masking the load) turns its output into NaN. The table is a column slice of a
    wider tensor, so its row stride is not its width.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(kv + block_size - 1) // block_size for _, kv in lens]
    max_blocks = max(blocks_per_seq, default=0) + 2
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    physical = torch.randperm(num_blocks, generator=gen)
    poison = int(physical[-1])  # a spare block
    wide_table = torch.full((len(lens), max_blocks + 3), poison, dtype=torch.int32)
    used = 0
    for s, ((_, kv_len), n_blocks) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        ids = physical[used : used + n_blocks]
        used += n_blocks
        wide_table[s, :n_blocks] = ids.to(torch.int32)
        slots = torch.arange(kv_len)
        owned[ids[slots // block_size], slots % block_size] = True
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    q_lens = [q for q, _ in lens]
    cu_q_lens = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    num_tokens = int(cu_q_lens[-1])
    if q_from_fused_qkv:  # q as a strided view of a fused projection output, as a model passes it
        qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        q = qkv.to(device)[:, :num_q_heads]
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    return Batch(
        q=q,
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        cu_q_lens=cu_q_lens.to(device),
        kv_lens=torch.tensor([kv for _, kv in lens], dtype=torch.int32, device=device),
        block_tables=wide_table.to(device)[:, :max_blocks],
    )


def check(batch: Batch, scale: float, sliding_window=None, softcap=None, **kernel_kwargs) -> torch.Tensor:
    """Runs kernel and reference; asserts they agree (and are finite) on every real token."""
    expected = ragged_paged_attention_ref(*batch.args(), scale, sliding_window, softcap)
    actual = triton_attention.ragged_paged_attention_triton(
        *batch.args(), scale, sliding_window, softcap, **kernel_kwargs
    )
    assert actual.shape == batch.q.shape and actual.dtype == batch.q.dtype
    assert torch.isfinite(actual.float()).all()
    tol = TOLERANCE[batch.q.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
    return actual


MIXED = [(1, 77), (5, 18), (29, 29)]  # decode, chunked prefill, fresh prefill


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mixed_prefill_and_decode(device, dtype):
    batch = make_batch(MIXED, 4, 2, 64, 16, dtype, device)
    check(batch, scale=64**-0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"),
    [(4, 4), (4, 2), (6, 2), (8, 2), (4, 1)],
    ids=["mha", "gqa2", "gqa3", "gqa4", "mqa"],
)
def test_gqa_ratios(device, num_q_heads, num_kv_heads):
    batch = make_batch([(1, 40), (17, 17), (3, 35)], num_q_heads, num_kv_heads, 32, 16, torch.float32, device)
    check(batch, scale=0.2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("head_dim", "block_size"), [(32, 8), (64, 16), (128, 32), (80, 16)])
def test_head_and_block_sizes(device, head_dim, block_size):
    # 80 is not a power of two: the head dimension is padded and masked inside the kernel
    batch = make_batch([(1, 70), (9, 41)], 4, 2, head_dim, block_size, torch.float32, device, seed=head_dim)
    check(batch, scale=head_dim**-0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("sliding_window", "softcap"),
    [(1, None), (7, None), (40, None), (None, 2.0), (9, 30.0)],
    ids=["win1", "win7", "win40", "softcap", "win9-softcap"],
)
def test_sliding_window_and_softcap(device, sliding_window, softcap):
    batch = make_batch([*MIXED, (2, 60)], 4, 2, 32, 8, torch.float32, device, seed=3)
    # scale 1.0 pushes scores far into the softcap's saturated range
    check(batch, scale=1.0 if softcap else 32**-0.5, sliding_window=sliding_window, softcap=softcap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sliding_window", [None, 5, 16], ids=["causal", "win5", "win16"])
def test_tile_boundary_sweep(device, sliding_window):
    """Query tiles start at every offset modulo the key tile (16 under the interpreter), so each
    causal-edge and window-start boundary case of the masked / unmasked key ranges occurs."""
    lens = [(5, 5 + ctx) for ctx in range(18)] + [(1, kv) for kv in (15, 16, 17, 31, 32, 33)]
    batch = make_batch(lens, 4, 2, 32, 8, torch.float32, device, seed=13)
    check(batch, scale=0.3, sliding_window=sliding_window)


@pytest.mark.parametrize("device", DEVICES)
def test_window_of_one_returns_own_value(device):
    """Exact expectation: with window 1 each query sees only its own key, so out == its V row."""
    batch = make_batch([(3, 20), (1, 1)], 2, 1, 32, 8, torch.float32, device, seed=7)
    out = check(batch, scale=1.0, sliding_window=1)
    table = batch.block_tables.cpu()
    for token, (seq, pos) in enumerate([(0, 17), (0, 18), (0, 19), (1, 0)]):
        block = int(table[seq, pos // 8])
        own_v = batch.v_cache[block, pos % 8, 0]
        for head in range(2):
            torch.testing.assert_close(out[token, head], own_v, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_only_with_and_without_split_kv(device):
    batch = make_batch([(1, 33), (1, 1), (1, 64), (1, 100), (1, 16)], 8, 2, 64, 16, torch.float32, device)
    single = check(batch, scale=0.125, num_kv_splits=1)
    split = check(batch, scale=0.125, num_kv_splits=4)  # some splits of short sequences are empty
    torch.testing.assert_close(split, single, atol=2e-6, rtol=0)
    check(batch, scale=0.125)  # the automatic choice


@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_on_prefill_with_window(device):
    batch = make_batch(MIXED, 4, 2, 32, 16, torch.float32, device, seed=11)
    check(batch, scale=0.2, sliding_window=21, num_kv_splits=3)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_query_sequences(device):
    lens = [(0, 12), (4, 30), (0, 1), (0, 50), (1, 9), (0, 7)]  # first, middle, repeated and last empty
    batch = make_batch(lens, 4, 2, 32, 8, torch.float32, device, q_from_fused_qkv=True)
    assert not batch.q.is_contiguous()
    check(batch, scale=0.2)
    check(batch, scale=0.2, num_kv_splits=2)


@pytest.mark.parametrize("device", DEVICES)
def test_no_queries_at_all(device):
    batch = make_batch([(0, 5), (0, 9)], 2, 2, 32, 8, torch.float32, device)
    out = triton_attention.ragged_paged_attention_triton(*batch.args(), 1.0)
    assert out.shape == (0, 2, 32)


@pytest.mark.parametrize("device", DEVICES)
def test_many_query_tiles_per_sequence(device):
    """Small tiles: a 40-token prefill spans 10 query tiles, found by the in-kernel binary search."""
    batch = make_batch([(2, 9), (40, 45), (1, 3), (13, 13)], 2, 2, 32, 8, torch.float32, device, seed=5)
    block_q = 4 if device == "cpu" else None  # compiled tl.dot needs >= 16 rows per program
    check(batch, scale=0.2, block_q=block_q, block_n=8 if device == "cpu" else None)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_inputs(device):
    batch = make_batch([(2, 9)], 4, 2, 32, 8, torch.float32, device)
    with pytest.raises(ValueError, match="int32"):
        triton_attention.ragged_paged_attention_triton(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.cu_q_lens.long(),
            batch.kv_lens,
            batch.block_tables,
            1.0,
        )
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_attention.ragged_paged_attention_triton(batch.q[:, :3], *batch.args()[1:], 1.0)


def test_public_entry_point_runs_triton_on_cpu_when_forced(monkeypatch):
    """kernels.ragged_paged_attention routes to the interpreted kernel under the env override."""
    if HAS_CUDA:
        pytest.skip("interpreter routing is checked where CUDA is absent")
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = triton_attention.ragged_paged_attention_triton
    monkeypatch.setattr(
        triton_attention, "ragged_paged_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    batch = make_batch([(3, 10)], 2, 1, 32, 8, torch.float32, "cpu")
    out = kernels.ragged_paged_attention(*batch.args(), 0.5)
    assert calls == [1]
    torch.testing.assert_close(out, ragged_paged_attention_ref(*batch.args(), 0.5), atol=2e-5, rtol=2e-5)


# ---- CUDA only: bf16, production-sized tiles, int32 offset overflow ------------------------------


@pytest.mark.parametrize("num_q_heads", [8, 32], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_cuda_realistic_batch(device, dtype, num_q_heads):
    lens = [(1, 1000), (1, 4097), (300, 300), (77, 2000), (0, 10), (1, 33)] + [(1, 513)] * 20
    batch = make_batch(lens, num_q_heads, 8, 128, 16, dtype, device)
    check(batch, scale=128**-0.5)
    check(batch, scale=128**-0.5, sliding_window=256, softcap=50.0)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_cuda_int32_offset_overflow(device):
    """A cache of > 2**31 elements: blocks near its end have element offsets beyond int32."""
    num_blocks, block_size, num_kv_heads, head_dim = 140_000, 16, 8, 128  # 2.3e9 elements per cache
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~10 GiB of free GPU memory")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.float16, device=device)
    v_cache = torch.randn(shape, dtype=torch.float16, device=device)
    last = torch.arange(num_blocks - 64, num_blocks, dtype=torch.int32, device=device)
    block_tables = torch.stack([last.flip(0), last])  # 64 blocks each, all past the int32 edge
    cu_q_lens = torch.tensor([0, 1, 51], dtype=torch.int32, device=device)
    kv_lens = torch.tensor([1000, 1024], dtype=torch.int32, device=device)
    q = torch.randn(51, 16, head_dim, dtype=torch.float16, device=device)
    batch = Batch(q, k_cache, v_cache, cu_q_lens, kv_lens, block_tables)
    check(batch, scale=head_dim**-0.5)
    check(batch, scale=head_dim**-0.5, num_kv_splits=8)


# ---- CPU: ahead-of-time compile for an H100 (catches compiled-Triton errors the interpreter misses)

# NOTE: runs in a subprocess: once triton is imported under TRITON_INTERPRET=1 its own library
# functions are interpreted and the real compiler cannot be used in the same process.
_COMPILE_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvmesh.kernels import triton_attention

def compile_sm90(name, types, constexprs, num_warps):
    fn = getattr(triton_attention, name)
    # what the JIT infers for contiguous inputs: unit last-dim strides, 16-divisible pointers
    unit = {n: 1 for n in fn.arg_names if n.startswith("stride_") and n.endswith("d")}
    constexprs = {**unit, **constexprs}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n.endswith("_ptr")}
    source = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return {"cubin_bytes": len(kernel.asm["cubin"]), "shared": kernel.metadata.shared}

print(json.dumps([compile_sm90(*job) for job in json.loads(sys.argv[1])]))
"""


@pytest.mark.parametrize(
    ("dtype", "decode", "group", "head_dim", "page_size", "extras"),
    [("bf16", True, 4, 128, 16, True), ("fp16", False, 3, 80, 16, False), ("bf16", False, 7, 64, 64, False)],
    ids=["bf16-decode-gqa4-d128-split-window-softcap", "fp16-prefill-gqa3-d80", "bf16-prefill-gqa7-d64-page64"],
)
def test_compiles_for_h100_without_a_gpu(dtype, decode, group, head_dim, page_size, extras):
    """The kernels compile to sm_90 cubin with the launch shapes the wrapper would pick: a tile of
    several pages (a table load per page), and one inside a page (one load per tile)."""
    import json
    import subprocess
    from pathlib import Path

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    head_dim_pad = 1 << (head_dim - 1).bit_length()
    config = triton_attention.attention_config(decode, torch_dtype, head_dim, group)
    block_q, block_n = max(1, config.block_m // group), config.block_n
    block_m = max(16, 1 << (block_q * group - 1).bit_length())
    types = {n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    types.update({"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "scale_log2": "fp32", "softcap": "fp32"})
    types.update({n: "*i32" for n in ("cu_q_lens_ptr", "kv_lens_ptr", "block_tables_ptr")})
    constexprs = dict(
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, USE_WINDOW=extras, USE_SOFTCAP=extras,
        SPLIT_KV=extras, DOT_PRECISION="tf32",
    )  # fmt: skip
    jobs = [["_ragged_paged_attention_kernel", types, constexprs, config.num_warps]]
    if extras:
        combine_types = {"out_ptr": f"*{dtype}", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
        combine_types["cu_q_lens_ptr"] = "*i32"
        jobs.append(
            [
                "_combine_kv_splits_kernel",
                combine_types,
                {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "SPLITS_PAD": 16},
                2,
            ]
        )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(jobs)],
        capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.splitlines()[-1])
    assert len(compiled) == len(jobs)
    for kernel in compiled:
        assert kernel["cubin_bytes"] > 0 and kernel["shared"] <= 227 * 1024  # H100 max per block


CONFIG_CASES = [
    (decode, dtype, head_dim)
    for decode in (True, False)
    for dtype in (torch.float32, torch.float16)
    for head_dim in (64, 128)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("decode", "dtype", "head_dim"), CONFIG_CASES,
                         ids=[f"{'decode' if d else 'prefill'}-{str(t)[6:]}-d{h}" for d, t, h in CONFIG_CASES])
def test_each_launch_config_is_exact(device, decode: bool, dtype: torch.dtype, head_dim: int) -> None:
    """The launch a GPU batch of each kind gets (tiles of several pages, its key tile), run here
    with those tiles: configs are tunable per (head dim, group, phase, dtype) without changing
    results. Decode batches get the split path too (two splits), as a small grid would."""
    config = triton_attention.attention_config(decode, dtype, head_dim, 4)
    lens = [(1, 70), (1, 5), (1, 129)] if decode else [(70, 70), (3, 40), (1, 17)]
    batch = make_batch(lens, 8, 2, head_dim, 16, dtype, device, seed=head_dim)
    check(batch, head_dim**-0.5, config=config, **({"num_kv_splits": 2} if decode else {}))


SHAPE_IDS = [f"{hq}-{hkv}x{d}" for hq, hkv, d in attention_configs.SERVED_HEAD_SHAPES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), attention_configs.SERVED_HEAD_SHAPES,
                         ids=SHAPE_IDS)
def test_every_served_head_shape_is_exact(device, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Each head shape kvmesh serves, with the committed table's launch for it (GPU-sized tiles,
    one table load per page): a prefill-heavy batch (a chunk after earlier tokens, a fresh prompt,
    a decode) and a decode-heavy one with two splits."""
    group = num_q_heads // num_kv_heads
    prefill = make_batch([(1, 40), (9, 33), (12, 12)], num_q_heads, num_kv_heads, head_dim, 16, torch.float32,
                         device, seed=group)
    check(prefill, head_dim**-0.5, config=triton_attention.attention_config(False, torch.float32, head_dim, group))
    decode = make_batch([(1, 70), (1, 3)], num_q_heads, num_kv_heads, head_dim, 16, torch.float32, device,
                        seed=head_dim)
    check(decode, head_dim**-0.5, config=triton_attention.attention_config(True, torch.float32, head_dim, group),
          num_kv_splits=2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_page_size_that_is_not_a_power_of_two(device):
    """Pages of 12 tokens: the table is read per key (tiles do not cover whole pages)."""
    batch = make_batch([(1, 50), (7, 30), (13, 13)], 6, 2, 32, 12, torch.float32, device, seed=9)
    check(batch, scale=0.2)
    check(batch, scale=0.2, num_kv_splits=2)


def test_the_committed_table_covers_every_served_shape() -> None:
    """attention_configs.json parses, holds every served shape's decode and prefill launch for each
    dtype, and an entry not marked as tuned on a GPU is the default (what a CPU writes)."""
    table = attention_configs.load_table()
    for hq, hkv, d in attention_configs.SERVED_HEAD_SHAPES:
        for decode in (True, False):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                key = (d, hq // hkv, "decode" if decode else "prefill", attention_configs.DTYPE_NAMES[dtype])
                assert key in table.configs, key
                if key not in table.tuned_on:
                    assert table.configs[key] == attention_configs.default_attention_config(
                        decode, dtype, attention_configs.head_dim_pad(d)), key
    assert table.note
    round_trip = attention_configs.ConfigTable.from_json(table.to_json())
    assert round_trip.configs == table.configs and round_trip.split_kv == table.split_kv


def test_tuned_configs_and_the_split_policy_are_looked_up() -> None:
    tuned = triton_attention.AttentionConfig(block_m=32, block_n=128, num_warps=8, num_stages=3)
    table = attention_configs.ConfigTable({(128, 4, "prefill", "bf16"): tuned}, attention_configs.SplitKVPolicy(),
                                          {(128, 4, "prefill", "bf16"): "H200 2026-12-01"})
    assert attention_configs.attention_config(False, torch.bfloat16, 128, 4, table) is tuned
    assert attention_configs.attention_config(False, torch.bfloat16, 128, 7, table).block_m == 64  # not in it
    assert attention_configs.attention_config(True, torch.bfloat16, 128, 4, table).block_m == 16
    assert attention_configs.attention_config(False, torch.float32, 256, 1, table).block_n == 16


def test_split_count_comes_from_shapes_and_the_policy() -> None:
    choose = triton_attention.choose_num_kv_splits
    policy = attention_configs.SplitKVPolicy(max_splits=16, min_tiles_per_split=4, programs_per_sm=1)
    assert choose(True, 32, 16384, 64, 132, policy) == 4  # cdiv(132, 32) = 5 -> a power of two
    assert choose(True, 512, 16384, 64, 132, policy) == 1  # the grid fills the GPU
    assert choose(False, 32, 16384, 64, 132, policy) == 1  # prefill-heavy batches never split
    assert choose(True, 4, 16384, 64, 132, policy) == 16  # at most max_splits
    assert choose(True, 4, 512, 64, 132, policy) == 2  # a short table keeps 4 tiles a split
    busy = attention_configs.SplitKVPolicy(programs_per_sm=4)  # split until 4 programs an SM
    assert choose(True, 288, 8192, 64, 132, busy) == 2  # Qwen2-0.5B's 144 sequences x 2 KV heads
    assert choose(True, 600, 8192, 64, 132, busy) == 1


def test_head_shapes_the_kernel_cannot_run_are_named() -> None:
    for shape in attention_configs.SERVED_HEAD_SHAPES:
        attention_configs.check_head_shape(*shape)
    attention_configs.check_head_shape(12, 4, 80)  # a padded head dim
    with pytest.raises(ValueError, match=r"head dim 512 \(it runs 1-256\)"):
        attention_configs.check_head_shape(32, 8, 512)
    with pytest.raises(ValueError, match="128 query heads per KV head"):
        attention_configs.check_head_shape(128, 1, 64)
    with pytest.raises(ValueError, match="not a multiple"):
        attention_configs.check_head_shape(14, 4, 64)

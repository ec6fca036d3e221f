"""Decode batches at padded sizes (graph_runner.py): the sizes, and padding that no real row sees.

On the CPU the padded decode path runs without capture (``decode_graphs(capture=False)``): the same
static buffers, padding and step body a CUDA graph replays. The engine then runs in float32 on
``ENGINE_DEVICE`` (tests/support/model_worker.py); the CUDA captures are tests/model_worker/execution/test_gpu_runner.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.graph_runner import (
    MAX_CAPTURE_SIZE,
    DecodeGraphs,
    capture_sizes,
    padded_size,
)
from tests.support.model_worker import EXACT, hf_greedy, random_prompt


def test_default_sizes_are_nano_vllms_up_to_max_num_seqs() -> None:
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    big = capture_sizes(4096)
    assert big[-1] == MAX_CAPTURE_SIZE == 512 and len(big) == 4 + 32
    assert capture_sizes(128, [8, 3, 8, 64]) == [3, 8, 64]


def test_padded_size_is_the_smallest_size_that_holds_the_batch() -> None:
    sizes = [1, 2, 4, 8, 16, 32]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 8, 8, 16, 32, 32, None]


class Spy:
    """Records (real rows, padded size) of every padded step."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.steps: list[tuple[int, int]] = []
        real = graphs._step

        def step(size: int) -> torch.Tensor:
            self.steps.append((graphs.num_rows, size))
            return real(size)

        graphs._step = step  # type: ignore[method-assign]


def padded_llm(model_dir: Path, sizes: list[int], **kwargs) -> tuple[LLM, Spy]:
    llm = LLM(str(model_dir), num_blocks=96, max_model_len=256, max_num_batched_tokens=64,
              cuda_graph_sizes=sizes, **{**EXACT, **kwargs})
    runner = llm.engine.runner
    runner.graphs = runner.decode_graphs(capture=False)
    return llm, Spy(runner.graphs)


def null_blocks_untouched(llm: LLM) -> bool:
    return all(bool((a.k_cache[0] == 0).all() and (a.v_cache[0] == 0).all()) for a in llm.engine.runner.attention_layers)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_padded_decode_gives_every_real_row_its_own_tokens(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    # Five requests finishing at different times: decode batches of 5, 4, 3, 2, 1 rows run in
    # the graphs of 8, 4, 4, 2 and 1 rows (3 real rows beside 5 padding rows, 1 beside 3, ...);
    # 6 is over the largest size, 8: such a batch runs eagerly.
    prompts = [random_prompt(n, seed=n) for n in (40, 7, 19, 1, 33, 12)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (14, 9, 6, 11, 3, 5)]
    llm, spy = padded_llm(model_dir, [1, 2, 4, 8] if arch == "llama" else [2, 8], max_num_seqs=8)
    outs = llm.generate(prompts, params)
    assert any(size > rows for rows, size in spy.steps), spy.steps  # padding was there
    assert {size for _, size in spy.steps} <= {1, 2, 4, 8}
    for p, o, sp in zip(prompts, outs, params, strict=True):
        assert o.token_ids == hf_greedy(model_dir, p, sp.max_tokens)
    assert null_blocks_untouched(llm)  # padding rows write nothing


def test_batches_over_the_largest_size_run_eagerly(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(5 + i, seed=200 + i) for i in range(6)]
    llm, spy = padded_llm(model_dir, [2, 4])
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert spy.steps == []  # six rows decode together all the way: never in a graph of 4
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 4) for p in prompts]


def test_padded_multi_step_windows_keep_and_drop_rows(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    # Windows of 8 steps: rows finish inside windows (3, 7, 12 tokens), so the batch shrinks in
    # place (keep) and moves to a smaller graph mid-window.
    prompts = [random_prompt(n, seed=300 + n) for n in (9, 23, 4, 17)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 7, 12, 20)]
    llm, spy = padded_llm(model_dir, [1, 2, 4], num_scheduler_steps=8)
    outs = llm.generate(prompts, params)
    sizes = [size for _, size in spy.steps]
    assert 4 in sizes and 2 in sizes and 1 in sizes, spy.steps
    assert (3, 4) in spy.steps  # three real rows in the graph of four
    for p, o, sp in zip(prompts, outs, params, strict=True):
        assert o.token_ids == hf_greedy(model_dir, p, sp.max_tokens)
    assert null_blocks_untouched(llm)


def test_padded_and_eager_decode_agree_on_sampled_requests(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    prompts = [random_prompt(n, seed=400 + n) for n in (11, 30, 5)]
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7 + i) for i in range(3)]
    eager = LLM(str(model_dir), num_blocks=96, max_model_len=256, **EXACT).generate(prompts, params)
    llm, spy = padded_llm(model_dir, [4])
    padded = llm.generate(prompts, params)
    assert spy.steps and [o.token_ids for o in padded] == [o.token_ids for o in eager]


def test_graph_buffers_refuse_what_they_cannot_hold() -> None:
    graphs = DecodeGraphs(lambda ids, pos, metas: torch.zeros(ids.shape[0], 5), sizes=[1, 2], num_groups=1,
                          max_blocks=3, block_size=4, vocab_size=5, device=torch.device("cpu"), capture=False)
    with pytest.raises(ValueError, match="captured sizes go up to 2"):
        graphs.load([1, 2, 3], [0, 0, 0], [[[1], [2], [3]]])
    with pytest.raises(ValueError, match="block table of 4 blocks"):
        graphs.load([1], [0], [[[1, 2, 3, 4]]])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(lambda *a: torch.zeros(1), sizes=[1], num_groups=1, max_blocks=1, block_size=1, vocab_size=1,
                     device=torch.device("cpu"), capture=True)


def test_padding_rows_carry_no_slot_and_stay_put() -> None:
    seen = []

    def forward_logits(ids, positions, metas):
        seen.append((ids.tolist(), positions.tolist(), metas[0].slot_mapping.tolist(), metas[0].kv_lens.tolist()))
        return torch.zeros(ids.shape[0], 3)

    graphs = DecodeGraphs(forward_logits, sizes=[4], num_groups=1, max_blocks=4, block_size=2, vocab_size=3,
                          device=torch.device("cpu"), capture=False)
    graphs.load([7, 8], [2, 5], [[[3, 4], [5, 6, 9, 10]]])
    graphs.run()
    graphs.feed(torch.tensor([11, 12]))
    graphs.run()
    # Row 0: position 2 is block 4 offset 0 (slot 8); row 1: position 5 is block 9 offset 1 (slot 19).
    assert seen[0] == ([7, 8, 0, 0], [2, 5, 0, 0], [8, 19, -1, -1], [3, 6, 1, 1])
    assert seen[1] == ([11, 12, 0, 0], [3, 6, 0, 0], [9, 20, -1, -1], [4, 7, 1, 1])
    graphs.keep(torch.tensor([1]))  # row 0 finished: row 1 alone, in the graph of 4 still
    graphs.run()
    assert seen[2] == ([12, 0, 0, 0], [7, 0, 0, 0], [21, -1, -1, -1], [8, 1, 1, 1])


def test_append_only_tables_write_only_new_blocks_and_equal_whole_writes(monkeypatch) -> None:
    """load() with the KV cache manager's own lists (append-only) writes only the blocks appended
    since a row's last step; its buffers equal, step by step, those of whole-table writes, through
    rows that grow, swap lists, shrink, leave (padding) and come back in another row: each step's
    buffer equals a fresh one filled with that step's rows."""
    import random

    from kvmesh.model_worker.execution import graph_runner

    def graphs(append_only: bool) -> DecodeGraphs:
        return DecodeGraphs(lambda *a: torch.zeros(1), sizes=[1, 2, 4, 8], num_groups=2, max_blocks=12, block_size=4,
                            vocab_size=8, device=torch.device("cpu"), capture=False, append_only_tables=append_only)

    class Block:
        def __init__(self, block_id: int) -> None:
            self.block_id = block_id

    written = 0
    real_ids = graph_runner._block_ids

    def counted(blocks, start):
        nonlocal written
        out = real_ids(blocks, start)
        written += len(out)
        return out

    monkeypatch.setattr(graph_runner, "_block_ids", counted)
    rng = random.Random(5)
    fast, whole = graphs(True), graphs(False)
    live: dict[str, list[list[Block]]] = {}
    fast_written = whole_written = 0
    for step in range(400):
        for rid in list(live):  # a request ends, or is preempted and comes back with new lists
            if rng.random() < 0.04:
                del live[rid]
        while len(live) < 8 and rng.random() < 0.3:
            n = rng.randrange(1, 6)
            live[f"r{step}-{len(live)}"] = [[Block(rng.randrange(1, 99)) for _ in range(n)] for _ in range(2)]
        for lists in live.values():  # decodes: now and then a block completes and one is appended
            if len(lists[0]) < 12 and rng.random() < 0.25:
                for blocks in lists:
                    blocks.append(Block(rng.randrange(1, 99)))
        if not live:
            continue
        rows = list(live.values())
        if rng.random() < 0.03:
            rng.shuffle(rows)  # a batch in another order now and then
        tables = [[r[g] for r in rows] for g in range(2)]
        ids = [rng.randrange(50) for _ in rows]
        pos = [4 * len(r[0]) - 1 for r in rows]
        before = written
        fast.load(ids, pos, tables)
        fast_written += written - before
        before = written
        whole.load(ids, pos, [[[b.block_id for b in t] for t in g] for g in tables])
        whole_written += written - before
        want = torch.zeros_like(fast._inputs[: fast.size])  # the rows as a fresh buffer holds them
        want[:, graph_runner._KV_LEN] = 1
        for i, (token, p) in enumerate(zip(ids, pos, strict=True)):
            want[i, : graph_runner._SOURCE] = torch.tensor([p + 1, 1, p, token])
            for g in range(2):
                start = graph_runner._TABLES + g * fast._stride
                want[i, start : start + len(tables[g][i])] = torch.tensor([b.block_id for b in tables[g][i]])
        assert fast.size == whole.size
        assert torch.equal(fast._inputs[: fast.size], want), f"step {step}"
        assert torch.equal(whole._inputs[: whole.size], want), f"step {step}"
    assert fast_written < 0.25 * whole_written, (fast_written, whole_written)  # the appended blocks, mostly


def test_padded_decode_through_preemption_and_growing_tables_keeps_transformers_tokens(tiny_model_dir) -> None:
    """The decode graphs' block tables written as they grow (append-only lists): requests that run
    long enough to take new blocks, in a pool small enough to preempt some (re-admitted with new
    lists), still give transformers' greedy tokens."""
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed=100 + n) for n in (30, 21, 38, 9, 26, 17)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 33, 28, 45, 37, 30)]
    llm = LLM(str(model_dir), num_blocks=20, block_size=8, max_model_len=96, max_num_batched_tokens=64,
              max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8], **EXACT)
    runner = llm.engine.runner
    runner.graphs = runner.decode_graphs(capture=False)
    assert runner.graphs._append_only
    spy = Spy(runner.graphs)
    outs = llm.generate(prompts, params)
    assert spy.steps and llm.engine.scheduler.num_preemptions > 0
    for p, o, sp in zip(prompts, outs, params, strict=True):
        assert o.token_ids == hf_greedy(model_dir, p, sp.max_tokens)

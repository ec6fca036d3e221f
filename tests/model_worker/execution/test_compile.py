"""The compiled forward pass (--compile): attention stays one opaque op, tokens stay exact, and every
compile happens at warm-up. The engine runs in float32 on ``ENGINE_DEVICE`` against transformers in
float32 on the CPU (tests/support/model_worker.py); on the CPU inductor's C++ backend compiles it."""

from __future__ import annotations

import pytest
import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.forward_context import ForwardContext, forward_context
from kvmesh.model_worker.execution.warmup import dummy_inputs, warmup_batches
from tests.support.model_worker import EXACT, hf_greedy, random_prompt


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_attention_and_the_kv_write_are_one_opaque_op_in_the_graph(tiny_model_dir, arch: str) -> None:
    llm = LLM(str(tiny_model_dir(arch)), num_blocks=32, max_model_len=256, **EXACT)
    runner = llm.engine.runner
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(runner.model.forward, fullgraph=True, dynamic=True, backend=record)
    batch = warmup_batches(4, 64, 256, runner.block_size)[-1]  # a mixed batch
    ids, positions, metas = dummy_inputs(batch, len(runner.kv_cache_config.groups), runner.device)
    with torch.inference_mode(), forward_context(ForwardContext(runner.attention_layers, metas)):
        out = compiled(ids, positions)
        want = runner.model(ids, positions)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # the traced graph runs the same ops
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    attention = [n for n in calls if n.target in (torch.ops.kvmesh.paged_attention,
                                                  torch.ops.kvmesh.paged_attention.default)]
    assert [n.args[3] for n in attention] == [0, 1]  # one call per layer, by layer index
    # The caches and the metadata are no graph input: only the ids, the positions and the weights.
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert not any(tuple(getattr(n.meta.get("example_value"), "shape", ())) == tuple(runner.attention_layers[0]
                   .k_cache.shape) for n in inputs)
    assert not any("index_put" in str(n.target) or "scaled_dot_product" in str(n.target) for n in calls)


@pytest.mark.slow
def test_compiled_engine_is_token_exact_and_compiles_only_at_warm_up(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    llm = LLM(str(model_dir), num_blocks=96, max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8,
              num_scheduler_steps=4, cuda_graph_sizes=[1, 2, 4, 8], **{**EXACT, "compile": True})
    runner = llm.engine.runner
    assert runner.compiled is not None and llm.engine.warmup_report is not None
    if runner.graphs is None:  # the CPU: the padded decode path, run eagerly (compiled)
        runner.graphs = runner.decode_graphs(capture=False)
        runner.graphs.warm_up()
    compiles = runner.compiled.num_compiles
    assert compiles >= 2  # this model's T = 1 and T >= 2 graphs (at this warm-up or an earlier one)
    # Prefill chunks (48-token budget), mixed steps, windows of 4 and batches of 1 to 5 rows.
    prompts = [random_prompt(n, seed=500 + n) for n in (70, 3, 1, 26, 45)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 13, 5, 17, 2)]
    outs = llm.generate(prompts, params)
    for p, o, sp in zip(prompts, outs, params, strict=True):
        assert o.token_ids == hf_greedy(model_dir, p, sp.max_tokens)
    assert runner.compiled.num_compiles == compiles  # no request paid a compile

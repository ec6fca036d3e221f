"""LoRA adapters in the engine: greedy output token-exact with transformers + peft, mixed batches of
adapters and the base model, slots and the host cache, run-time loading, and configs refused.

Every adapter is peft's own ``save_pretrained`` output with ``init_lora_weights=False`` (B is random,
not zero), and each test checks the adapter changes the output: a test passes only when the engine
runs the adapter, in its slot, at its scale.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.models.lora import TARGET_MODULES
from tests.support.model_worker import EXACT, hf_greedy, random_prompt

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@cache
def _adapter(model_dir: str, out_dir: str, seed: int, r: int, alpha: float, targets: tuple[str, ...],
             rslora: bool, extra: tuple[tuple[str, object], ...] = ()) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        use_rslora=rslora, lora_dropout=0.0, **dict(extra))
    get_peft_model(base, config).save_pretrained(out_dir)
    return Path(out_dir)


def make_adapter(tmp_root: Path, model_dir: Path, seed: int, r: int = 8, alpha: float = 16,
                 targets: tuple[str, ...] = TARGET_MODULES, rslora: bool = False, **extra) -> Path:
    out = tmp_root / f"{model_dir.name}-{seed}-{r}-{alpha}-{'-'.join(targets)}-{rslora}-{sorted(extra.items())}"
    return _adapter(str(model_dir), str(out), seed, r, alpha, targets, rslora, tuple(sorted(extra.items())))


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters")


def peft_greedy(model_dir: Path, adapter_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers + peft ``generate``, greedy, float32, CPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_llm(model_dir: Path, modules: dict[str, Path], **kwargs) -> LLM:
    kwargs = {"num_blocks": 96, "max_model_len": 256, "max_num_batched_tokens": 256, **EXACT,
              "enable_lora": True, "max_loras": 4, **kwargs}
    return LLM(str(model_dir), lora_modules=[f"{n}={p}" for n, p in modules.items()], **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_adapter_greedy_matches_transformers_peft(tiny_model_dir, adapters_root, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    adapter = make_adapter(adapters_root, model_dir, seed=1)
    llm = make_llm(model_dir, {"a": adapter}, max_num_batched_tokens=32)  # 70 tokens: a chunked prefill
    prompts = [random_prompt(70, seed=3), random_prompt(9, seed=4)]
    outs = llm.generate(prompts, GREEDY, lora_names="a")
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == peft_greedy(model_dir, adapter, p, 10)
        assert o.token_ids != hf_greedy(model_dir, p, 10)  # the adapter changes the output


def test_rslora_and_a_subset_of_modules_match_peft(tiny_model_dir, adapters_root) -> None:
    """Scale alpha / sqrt(r) (rsLoRA), rank 4 in slots of rank 16, q/v/down only: the slices of the fused
    projections that are not adapted stay zero."""
    model_dir = tiny_model_dir("llama")
    adapter = make_adapter(adapters_root, model_dir, seed=2, r=4, alpha=6, targets=("q_proj", "v_proj", "down_proj"),
                           rslora=True)
    llm = make_llm(model_dir, {"rs": adapter})
    prompt = random_prompt(30, seed=5)
    (out,) = llm.generate([prompt], GREEDY, lora_names="rs")
    assert out.token_ids == peft_greedy(model_dir, adapter, prompt, 10)
    assert out.token_ids != hf_greedy(model_dir, prompt, 10)


def test_one_batch_of_four_adapters_and_the_base_equals_solo_runs(tiny_model_dir, adapters_root) -> None:
    model_dir = tiny_model_dir("llama")
    modules = {f"a{i}": make_adapter(adapters_root, model_dir, seed=10 + i) for i in range(4)}
    prompts = [random_prompt(n, seed=20 + n) for n in (33, 5, 17, 48, 12, 26, 9)]
    names: list[str | None] = ["a0", "a1", None, "a2", "a3", "a1", None]
    llm = make_llm(model_dir, modules, max_loras=4)
    spy: list[int] = []
    step = llm.engine.step

    def counting_step(*args, **kwargs):
        spy.append(len(llm.engine.scheduler.running))
        return step(*args, **kwargs)

    llm.engine.step = counting_step  # type: ignore[method-assign]
    together = llm.generate(prompts, GREEDY, lora_names=names)
    llm.engine.step = step  # type: ignore[method-assign]
    assert max(spy) == len(prompts)  # they ran in one batch
    solo = [make_llm(model_dir, modules, max_loras=1).generate([p], GREEDY, lora_names=n)[0].token_ids
            for p, n in zip(prompts, names, strict=True)]
    assert [o.token_ids for o in together] == solo
    for p, n, o in zip(prompts, names, together, strict=True):
        if n is None:
            assert o.token_ids == hf_greedy(model_dir, p, 10)
    # each adapter gives its own output: a wrong slot would not pass
    same_prompt = llm.generate([prompts[0]] * 5, GREEDY, lora_names=["a0", "a1", "a2", "a3", None])
    assert len({tuple(o.token_ids) for o in same_prompt}) == 5


def test_one_slot_swaps_adapters_and_rereads_from_disk(tiny_model_dir, adapters_root) -> None:
    """--max-loras 1 --max-cpu-loras 1 with three adapters: requests of another adapter wait for the slot;
    adapters leave host memory and are read again; every output is the adapter's own."""
    model_dir = tiny_model_dir("llama")
    modules = {f"s{i}": make_adapter(adapters_root, model_dir, seed=30 + i) for i in range(3)}
    llm = make_llm(model_dir, modules, max_loras=1, max_cpu_loras=1)
    prompt = random_prompt(20, seed=9)
    names = ["s0", "s1", "s2", "s0", None]
    outs = llm.generate([prompt] * 5, GREEDY, lora_names=names)
    for n, o in zip(names, outs, strict=True):
        want = hf_greedy(model_dir, prompt, 10) if n is None else peft_greedy(model_dir, modules[n], prompt, 10)
        assert o.token_ids == want, n
    manager = llm.engine.lora
    assert manager is not None
    assert manager.num_slot_loads >= 3 and manager.num_disk_loads > 3  # 3 at start-up, then re-reads
    assert len(manager.residency()["cpu"]) == 1 and len(manager.residency()["gpu"]) == 1


def test_load_and_unload_at_run_time(tiny_model_dir, adapters_root) -> None:
    model_dir = tiny_model_dir("qwen2")
    adapter = make_adapter(adapters_root, model_dir, seed=40)
    llm = make_llm(model_dir, {})
    prompt = random_prompt(12, seed=1)
    with pytest.raises(ValueError, match="no LoRA adapter 'late' is loaded"):
        llm.generate([prompt], GREEDY, lora_names="late")
    llm.engine.load_adapter("late", str(adapter))
    with pytest.raises(ValueError, match="already loaded"):
        llm.engine.load_adapter("late", str(adapter))
    (out,) = llm.generate([prompt], GREEDY, lora_names="late")
    assert out.token_ids == peft_greedy(model_dir, adapter, prompt, 10)
    llm.engine.add_request("busy", prompt, GREEDY, lora_name="late")
    with pytest.raises(ValueError, match="in use by 1 live requests"):
        llm.engine.unload_adapter("late")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.unload_adapter("late")
    with pytest.raises(ValueError, match="no LoRA adapter 'late' is loaded"):
        llm.generate([prompt], GREEDY, lora_names="late")
    with pytest.raises(ValueError, match="no LoRA adapter 'late' is loaded"):
        llm.engine.unload_adapter("late")


def test_a_prompt_under_two_adapters_is_two_chains(tiny_model_dir, adapters_root) -> None:
    model_dir = tiny_model_dir("llama")
    modules = {"x": make_adapter(adapters_root, model_dir, seed=50), "y": make_adapter(adapters_root, model_dir, seed=51)}
    llm = make_llm(model_dir, modules)
    prompt = random_prompt(70, seed=11)  # 4 full blocks of 16
    first = llm.generate([prompt], GREEDY, lora_names="x")[0]
    other = llm.generate([prompt], GREEDY, lora_names="y")[0]
    base = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY, lora_names="x")[0]
    assert (first.cached_tokens, other.cached_tokens, base.cached_tokens) == (0, 0, 0)  # no cross-adapter hit
    assert again.cached_tokens == 64 and again.token_ids == first.token_ids
    assert first.token_ids == peft_greedy(model_dir, modules["x"], prompt, 10)
    assert other.token_ids == peft_greedy(model_dir, modules["y"], prompt, 10)


def test_padded_decode_buffers_carry_each_rows_slot(tiny_model_dir, adapters_root) -> None:
    """The CUDA-graph path's static buffers (run eagerly on the CPU): each row's slot is an input."""
    model_dir = tiny_model_dir("llama")
    modules = {f"g{i}": make_adapter(adapters_root, model_dir, seed=60 + i) for i in range(2)}
    llm = make_llm(model_dir, modules, max_num_seqs=8, cuda_graph_sizes=[2, 4, 8])
    runner = llm.engine.runner
    runner.graphs = runner.decode_graphs(capture=False)
    prompts = [random_prompt(n, seed=n) for n in (21, 6, 14)]
    names = ["g0", None, "g1"]
    outs = llm.generate(prompts, GREEDY, lora_names=names)
    for p, n, o in zip(prompts, names, outs, strict=True):
        want = hf_greedy(model_dir, p, 10) if n is None else peft_greedy(model_dir, modules[n], p, 10)
        assert o.token_ids == want, n


def test_without_enable_lora_nothing_changes(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    llm = LLM(str(model_dir), num_blocks=64, max_model_len=256, **EXACT)
    assert llm.engine.lora is None
    assert not any("lora" in n for n, _ in llm.engine.runner.model.named_buffers())
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        llm.generate([[1, 2, 3]], GREEDY, lora_names="a")
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        LLM(str(model_dir), num_blocks=64, lora_modules=["a=/x"], **EXACT)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    conf = json.loads((dst / "adapter_config.json").read_text())
    conf.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    return dst


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"r": 32}, "rank 32 exceeds --max-lora-rank 16"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] are not supported"),
    ({"peft_type": "IA3"}, "only LORA adapters"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"r": 4}, r"has shape \(8, \d+\), expected \(4, \d+\)"),
])
def test_bad_adapters_are_refused_with_what_is_wrong(tiny_model_dir, adapters_root, tmp_path, changes, message) -> None:
    model_dir = tiny_model_dir("llama")
    good = make_adapter(adapters_root, model_dir, seed=70)
    bad = _edit_config(good, tmp_path / "bad", **changes)
    llm = make_llm(model_dir, {})
    with pytest.raises(ValueError, match=message):
        llm.engine.load_adapter("bad", str(bad))
    with pytest.raises(ValueError, match=message):
        make_llm(model_dir, {"bad": bad})


def test_an_adapter_of_another_model_or_no_adapter_is_refused(tiny_model_dir, adapters_root, tmp_path) -> None:
    llm = make_llm(tiny_model_dir("llama"), {})
    other = make_adapter(adapters_root, tiny_model_dir("qwen3"), seed=71)  # head_dim 24 x 6 heads: q is 144 wide
    with pytest.raises(ValueError, match="is it an adapter of this model"):
        llm.engine.load_adapter("other", str(other))
    with pytest.raises(ValueError, match="needs adapter_config.json and adapter_model.safetensors"):
        llm.engine.load_adapter("none", str(tmp_path))
    with pytest.raises(ValueError, match="name=path"):
        LLM(str(tiny_model_dir("llama")), num_blocks=64, enable_lora=True, lora_modules=["just-a-path"], **EXACT)


def test_compiled_forward_traces_lora_as_one_opaque_op_per_projection(tiny_model_dir, adapters_root) -> None:
    """Under torch.compile (fullgraph) the LoRA delta is the op ``kvmesh::lora_delta``, 4 per layer, reading
    the slots from the forward context: the traced graph gives the eager model's output for a mixed batch."""
    from kvmesh.model_worker.execution.forward_context import ForwardContext, LoRAMetadata, forward_context
    from kvmesh.model_worker.execution.warmup import dummy_inputs, warmup_batches

    model_dir = tiny_model_dir("qwen3")
    modules = {f"c{i}": make_adapter(adapters_root, model_dir, seed=80 + i) for i in range(2)}
    llm = make_llm(model_dir, modules)
    runner = llm.engine.runner
    assert runner.lora is not None
    slot_of = runner.lora.slots_for(["c0", "c1"])
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(runner.model.forward, fullgraph=True, dynamic=True, backend=record)
    batch = warmup_batches(4, 64, 256, runner.block_size)[-1]
    ids, positions, metas = dummy_inputs(batch, len(runner.kv_cache_config.groups), runner.device)
    slots = torch.tensor([slot_of["c0"], -1, slot_of["c1"]] * ids.shape[0], dtype=torch.int32)[: ids.shape[0]]
    with torch.inference_mode():
        with forward_context(ForwardContext(runner.attention_layers, metas, LoRAMetadata(slots))):
            out = compiled(ids, positions)
            want = runner.model(ids, positions)
        with forward_context(ForwardContext(runner.attention_layers, metas, LoRAMetadata(torch.full_like(slots, -1)))):
            base = runner.model(ids, positions)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, base)  # the adapters are in the compiled graph's output
    (gm,) = graphs
    lora_calls = [n for n in gm.graph.nodes if n.op == "call_function"
                  and n.target in (torch.ops.kvmesh.lora_delta, torch.ops.kvmesh.lora_delta.default)]
    assert len(lora_calls) == 4 * runner.model_config.num_layers

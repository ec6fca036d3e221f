"""The roofline step time (model_worker/simulated/step_time.py): which bound a step hits, the GPU types, the KV
capacity that follows memory, what a linear fit cannot represent, and the per-step noise."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.contract.types import H100_8B_KV_BLOCKS, SamplingParams
from kvmesh.make_model import ensure_default_model
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.scheduling.host_block_pool import KVTransfers
from kvmesh.model_worker.simulated.sim_runner import SimRunner
from kvmesh.model_worker.simulated.step_time import (
    GPUS,
    LLAMA_31_8B,
    LinearCost,
    Roofline,
    StepTimeConfig,
    gpu_spec,
    step_time_model,
)

H100 = Roofline(GPUS["H100"])
A100 = Roofline(GPUS["A100"])
KV = 128 * 1024  # 2 x 32 layers x 8 KV heads x 128 x 2 B


def test_llama_8b_shape():
    m = LLAMA_31_8B
    assert (m.kv_bytes_per_token, m.attn_flops_per_pair, m.weight_bytes) == (KV, 4 * 32 * 4096, 16.06e9)


def test_small_decode_batch_is_memory_bound_and_pays_weights_plus_kv():
    g = GPUS["H100"]
    bw = g.bandwidth * g.mbu
    # one sequence at 2,000 tokens of context: the weights and its KV read once
    t = H100.step_time([], [2000])
    assert t == pytest.approx((16.06e9 + KV * 2000) / bw + g.launch_s)
    assert H100.compute_s(0, 0, 1, 2000) < H100.memory_s(2000)
    assert 0.007 < t < 0.008  # ~7.5 ms inter-token latency at batch 1


def test_large_prefill_is_compute_bound_and_pays_flops():
    g = GPUS["H100"]
    flops = g.peak_flops * g.mfu
    pairs = 8192 * (8192 + 1) / 2
    t = H100.step_time([(0, 8192)], [])
    assert t == pytest.approx((2 * 8.03e9 * 8192 + 4 * 32 * 4096 * pairs) / flops + g.launch_s)
    assert H100.memory_s(8192) < H100.compute_s(8192, pairs, 0, 0)
    # decodes sharing a compute-bound step cost only their FLOPs, not their KV reads
    with_decodes = H100.step_time([(0, 8192)], [4096] * 64)
    assert with_decodes - t == pytest.approx(64 * (2 * 8.03e9 + 4 * 32 * 4096 * 4096) / flops)


def test_prefill_crosses_from_memory_to_compute_bound():
    # below the ridge a chunk costs the weight read whatever its size; above it, its FLOPs
    small = [H100.step_time([(0, n)], []) for n in (8, 32, 64)]
    assert max(small) - min(small) < 0.02 * min(small)
    big = [H100.step_time([(0, n)], []) for n in (1024, 2048)]
    assert big[1] - H100.gpu.launch_s == pytest.approx(2 * (big[0] - H100.gpu.launch_s), rel=0.02)
    crossover = next(n for n in range(1, 1024) if H100.compute_s(n, n * (n + 1) / 2, 0, 0) > H100.memory_s(n))
    assert 100 < crossover < 200  # W / BW_eff = 6.4 ms of GEMMs at 346 TFLOPS: ~138 tokens


def test_a100_is_slower_and_h200_decodes_faster():
    for prefills, decodes in (([(0, 8192)], []), ([], [2048] * 32), ([(1024, 512)], [512] * 8)):
        assert A100.step_time(prefills, decodes) > 1.4 * H100.step_time(prefills, decodes)
    h200 = Roofline(GPUS["H200"])
    assert h200.step_time([], [2048] * 32) < 0.8 * H100.step_time([], [2048] * 32)  # 4.8 vs 3.35 TB/s
    assert h200.step_time([(0, 8192)], []) == H100.step_time([(0, 8192)], [])  # the same compute


def test_kv_capacity_follows_memory():
    # 0.9 x memory - 15 GiB of weights - 3 GiB of activations, 128 KiB per token
    assert GPUS["H100"].kv_tokens() == H100_8B_KV_BLOCKS * 16 == 54 * 2**30 // KV
    assert GPUS["A100"].kv_tokens() == GPUS["H100"].kv_tokens()  # both 80 GB
    assert GPUS["H200"].kv_tokens() == int((0.9 * 141 - 18) * 2**30) // KV


def test_a_linear_fit_cannot_represent_the_roofline():
    # the learner's features (router/core/policies/cost.py) over a mix of decode, prefill and mixed steps
    rng = np.random.default_rng(0)
    rows, times = [], []
    for _ in range(400):
        n = int(rng.choice([0, 0, 64, 512, 2048, 8192]))
        d = int(rng.integers(0 if n else 1, 128))
        ctx = int(rng.integers(256, 16_384))
        pairs = n * (ctx + (n + 1) / 2)
        rows.append([1, n, pairs, d, d * ctx])
        times.append(H100.time(n, pairs, d, d * ctx))
    x, y = np.array(rows, dtype=float), np.array(times)
    scale = x.max(axis=0)
    coef, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
    err = np.abs(x / scale @ coef - y) / y
    assert err.max() > 0.2
    # while the linear model itself is fitted exactly by the same least squares
    lin = LinearCost()
    y2 = np.array([lin.time(int(r[1]), r[2], int(r[3]), int(r[4])) for r in rows])
    coef2, *_ = np.linalg.lstsq(x / scale, y2, rcond=None)
    assert np.abs(x / scale @ coef2 - y2).max() < 1e-9


def test_config_names_models_and_refuses_what_it_cannot_model():
    assert StepTimeConfig().model() == H100
    assert StepTimeConfig(gpu="a100").model() == A100
    assert isinstance(StepTimeConfig(cost_model="linear").model(), LinearCost)
    with pytest.raises(ValueError, match="H100 coefficients only"):
        step_time_model("linear", "A100")
    with pytest.raises(ValueError, match="unknown GPU 'B300'; known: H100, H200, A100"):
        gpu_spec("B300")
    with pytest.raises(ValueError, match="--sim-step-noise"):
        StepTimeConfig(step_noise=-0.1).check()


def _step_times(noise: float, seed: int) -> list[float]:
    made: list[SimRunner] = []

    def factory(cfg, mc):
        made.append(SimRunner(cfg, mc, H100, time_scale=0.0, noise_sigma=noise, noise_seed=seed))
        return made[0]

    engine = LLMEngine(model=str(ensure_default_model()), num_blocks=64, max_model_len=512, runner_factory=factory)
    engine.add_request("a", list(range(2, 50)), SamplingParams(max_tokens=6, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        times.append(made[0].last_step_s)
    return times


def test_step_noise_is_seeded_and_off_by_default():
    plain = _step_times(0.0, seed=1)
    assert plain == _step_times(0.0, seed=2)  # no noise: the seed is unused
    assert plain[0] == H100.step_time([(0, 48)], [])
    noisy = _step_times(0.1, seed=1)
    assert noisy == _step_times(0.1, seed=1)  # the same seed, the same steps
    assert noisy != _step_times(0.1, seed=2)
    ratios = [n / p for n, p in zip(noisy, plain, strict=True)]
    assert all(0.6 < r < 1.6 for r in ratios) and len(set(ratios)) == len(ratios)
    assert StepTimeConfig().step_noise == 0.0


def test_host_copies_cross_the_host_link():
    # PCIe Gen5 x16 ~50 GB/s one way (H100, H200), Gen4 half that (A100), NVLink-C2C (GH200) ~7x
    assert H100.host_copy_s(2048) == pytest.approx(2048 * KV / 50e9)  # 5.4 ms for 2k tokens of Llama-8B
    assert A100.host_copy_s(2048) == pytest.approx(2 * H100.host_copy_s(2048))
    assert Roofline(GPUS["GH200"]).host_copy_s(2048) == pytest.approx(2048 * KV / 360e9)
    # loading a prefix back is far cheaper than computing it again: the host tier's reason to be
    assert H100.host_copy_s(8192) < 0.15 * H100.step_time([(0, 8192)], [])
    assert LinearCost().host_copy_s(2048) == H100.host_copy_s(2048) and LinearCost().kv_bytes_per_token == KV


def test_a_simulated_worker_times_its_host_tier_copies():
    """The simulated runner runs the real host tier (blocks, events, loads) and times its copies:
    a step's loads before its forward pass, its offloads beside it."""
    made: list[SimRunner] = []

    def factory(cfg, mc):
        made.append(SimRunner(cfg, mc, H100, time_scale=0.0))
        return made[0]

    # 9 usable blocks of 16; a 1/64 GiB tier = 8 blocks of 16 tokens of Llama-8B's KV (2 MiB each)
    engine = LLMEngine(model=str(ensure_default_model()), num_blocks=10, max_model_len=128,
                       kv_offloading_size=1 / 64, runner_factory=factory)
    runner = made[0]
    assert runner.num_host_blocks == 8 == engine.stats().num_host_blocks
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def step_of(rid: str, prompt: list[int]) -> float:
        engine.add_request(rid, prompt, params)
        engine.step()
        assert not engine.has_unfinished_requests()
        return runner.last_step_s

    copies: list[KVTransfers] = []
    real = runner.copy_kv_blocks
    runner.copy_kv_blocks = lambda t: copies.append(t) or real(t)
    shared = list(range(2, 66))  # 4 blocks
    assert step_of("a", shared) == H100.step_time([(0, 64)], [])
    # 80 tokens (5 blocks) take the 5 blocks never used; c's 4 blocks evict a's to the host tier
    assert step_of("b", list(range(100, 180))) == H100.step_time([(0, 80)], [])
    t = step_of("c", list(range(200, 264)))
    assert [len(c.offloads) for c in copies] == [4]
    # the evicted blocks' copies ran beside this prefill and hid behind it
    assert t == H100.step_time([(0, 64)], []) > H100.host_copy_s(4 * 16)
    assert not set(engine.block_hasher.hash_prompt(shared)) & engine.cached_block_hashes()
    # a again: three blocks loaded back (its last token is computed), the rest of its last block computed
    t = step_of("a2", shared)
    assert engine.stats().host_cache_hits == 48 and len(copies[1].loads) == 3
    offload_s = H100.host_copy_s(16 * len(copies[1].offloads))
    assert t == pytest.approx(H100.host_copy_s(48) + max(H100.step_time([(48, 16)], []), offload_s))
    # the loads are reported with the load: blocks and modelled seconds, for routers to learn the link
    s = engine.stats()
    assert (s.host_loaded_blocks, s.host_load_s) == (3, pytest.approx(H100.host_copy_s(48)))
    load = engine.report_load()
    assert (load.host_loaded_blocks, load.host_load_s) == (3, s.host_load_s)
    # offloads longer than the step are what it cannot hide
    runner.copy_kv_blocks(KVTransfers(offloads=[(i, i) for i in range(256)]))
    assert runner.copy_s(0.001) == H100.host_copy_s(256 * 16) > 0.001
    assert runner.copy_s(0.001) == 0.001  # once: the copies belong to one step

"""`make gpu-check` on a machine without a GPU: what can be checked without one (scripts/gpu_check.py).

The import check names what is missing, the check refuses cleanly without CUDA, a source checkout
is laid out as the wheel lays it, and the goal table is assembled from the parts' figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check
_spec.loader.exec_module(gpu_check)


def test_missing_imports_and_binaries_are_named_with_their_pip_packages() -> None:
    absent = {"grpc", "redis", "google.protobuf"}
    found = gpu_check.missing(["torch", "grpc", "redis", "google.protobuf", "grpc", "redis-server"],
                              find=lambda m: None if m in absent else object(), which=lambda b: None)
    assert found == ["grpc", "redis", "google.protobuf", "redis-server"]
    line = gpu_check.describe_missing(found)
    assert line == ("missing: pip packages grpcio, redis, protobuf (imports grpc, redis, google.protobuf); "
                    "the redis-server binary")
    assert gpu_check.describe_missing([]) == "nothing missing"


def test_a_part_whose_parent_package_is_absent_counts_as_missing() -> None:
    def find(name: str):
        raise ModuleNotFoundError(name)

    assert gpu_check.missing(["google.protobuf"], find=find) == ["google.protobuf"]


def test_every_part_needs_only_known_packages() -> None:
    names = [p.name for p in gpu_check.PARTS]
    assert names == ["model", "cuda-tests", "kernel-bench", "decode-1b", "decode-qwen", "multistep", "warm-start",
                     "mesh", "host-tier", "ncu"]
    for part in gpu_check.PARTS:
        assert all(m in gpu_check.PACKAGES or m == "redis-server" for m in part.needs), part.name
    assert sum(p.budget_s for p in gpu_check.PARTS) >= 480  # the overall budget is what cuts


def test_it_refuses_cleanly_without_cuda() -> None:
    assert gpu_check.cuda_refusal(True, True) is None
    assert "torch is not importable" in gpu_check.cuda_refusal(False, False)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--json", os.devnull],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "needs an NVIDIA GPU with CUDA" in done.stderr
    assert done.stdout.startswith("gpu-check imports: ")


def test_a_source_checkout_is_importable_as_the_wheel_lays_it_out(tmp_path: Path) -> None:
    env = gpu_check.source_tree_env(ROOT, importable=False)
    assert env["PYTHONSAFEPATH"] == "1"
    code = ("import kvmesh, kvmesh.model_worker.execution.graph_runner, kvmesh.kernels.dispatch, kvmesh.router.config; "
            "import decode_profile, tests.support; print(kvmesh.__path__[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env})
    assert done.returncode == 0, done.stderr
    assert "kvmesh-gpu-check-" in done.stdout  # the staged layout, not an installed copy
    assert gpu_check.source_tree_env(ROOT, importable=True) == {}


def outcome(figures: dict) -> object:
    return gpu_check.Outcome("ok", 1.0, figures)


def test_the_goal_table_reads_each_part_and_says_what_did_not_run() -> None:
    GB = 1e9
    outcomes = {
        "decode-1b": outcome({"modes": {"graphs": {"prompts": {
            "128": {"64": {"wall_ms": 1.2, "gpu_busy_ms": 1.0, "launches": 2}},
            "2048": {"64": {"wall_ms": 2.0, "gpu_busy_ms": 1.8, "weight_bytes": 3 * GB, "kv_bytes": 1.2 * GB}}}}}}),
        "decode-qwen": outcome({"modes": {"graphs": {"prompts": {"128": {"128": {"wall_ms": 1.3, "gpu_busy_ms": 0.9}}}}}}),
        "multistep": outcome({"steps": {"1": {"tok_s": 9_000.0}, "8": {"tok_s": 41_000.0}}}),
        "kernel-bench": gpu_check.Outcome("timed out", 90.0, {"copy_gbps": 4200.0, "shapes": {
            "32/8x128": {"scenarios": {"prefill-heavy": {"triton_over_sdpa": 0.95},
                                       "decode-heavy": {"triton_over_sdpa": 0.92, "triton": {"gbps": 3780.0}}}},
            "14/2x64": {"scenarios": {"prefill-heavy": {"triton_over_sdpa": 0.74},
                                      "decode-heavy": {"triton_over_sdpa": None}}}}}),
        "warm-start": outcome({"configs": {"default": {"with_warmup": {"ratio": 1.2, "first_ttft_ms": 7.2,
                                                                       "warm_ttft_ms": 6.0}}}}),
        "host-tier": outcome({"prefixes": {
            "512": {"host_over_device": 1.6, "host_ms": 8.0, "device_ms": 5.0, "recomputed_ms": 9.0,
                    "host_hits_served": True},
            "2048": {"host_over_device": 0.9, "host_ms": 9.0, "device_ms": 10.0, "recomputed_ms": 30.0,
                     "host_hits_served": False}}}),
        "ncu": gpu_check.Outcome("skipped: ncu not found", 0.1),
        "cuda-tests": outcome({"passed": 170, "failed": 0, "skipped": 3}),
        "mesh": gpu_check.Outcome("timed out", 120.0),
    }
    rows = {r["measure"]: r for r in gpu_check.goal_rows(outcomes)}
    step = rows["decode step, batch 64, 1B shape, prompt 128, wall"]
    assert (step["figure"], step["verdict"]) == ("1.20 ms (GPU busy 1.00 ms)", "met")
    assert rows["kernel launches per decode step (graph replay = 1)"]["verdict"] == "reported"
    # 2.0 ms against (3.0 + 1.2) GB at 4,200 GB/s = 1.0 ms
    long = rows["decode step, 1B shape, 64 x 2,048 context / (weights + KV) at copy bandwidth"]
    assert (long["figure"][:4], long["verdict"]) == ("2.00", "not met")
    assert rows["decode step, Qwen2-0.5B shape, batch 128, wall"]["verdict"] == "not met"
    assert rows["output tok/s, 64 requests x 128 out, best MS"]["verdict"] == "met"
    # A part cut by its budget keeps what it measured; a shape with a scenario missing is not met.
    kb = rows["Triton / SDPA, 32/8x128: prefill / decode / mixed / small-batch"]
    assert (kb["figure"], kb["verdict"]) == ("0.95 / 0.92", "met")
    assert rows["Triton / SDPA, 14/2x64: prefill / decode / mixed / small-batch"]["verdict"] == "not run"
    bw = rows["decode-heavy bandwidth, 32/8 x 128, bf16 / copy bandwidth"]
    assert (bw["figure"], bw["verdict"]) == ("0.90 (3,780 of 4,200 GB/s)", "met")
    assert rows["TTFT of the first request after ready / warm TTFT"]["figure"] == "1.20 (7.2 vs 6.0 ms)"
    assert rows["2 workers at 0.4 started together, both mesh workloads"]["verdict"] == "not run"
    assert rows["host-hit / device-hit TTFT, 512-token prefix"]["verdict"] == "met"
    # a probe the tier did not serve measures nothing about the tier
    assert rows["host-hit / device-hit TTFT, 2048-token prefix"]["verdict"] == "not run"
    assert rows["CUDA tests (kernels + model_worker, -m cuda)"]["verdict"] == "met"
    assert not any(m.startswith("ncu ") for m in rows)  # skipped: no rows, its reason in the part list
    table = gpu_check.format_table(list(rows.values()), outcomes)
    assert "part mesh" in table and "timed out" in table and "skipped: ncu not found" in table
    json.dumps(list(rows.values()))  # every row goes to the JSON as it is


def test_a_part_that_exits_3_is_skipped_with_its_reason_and_a_failed_part_says_why(tmp_path: Path, capsys) -> None:
    script = tmp_path / "part.py"
    script.write_text("import sys\nprint('working', flush=True)\nprint('no ncu on this machine', file=sys.stderr)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    skip = gpu_check.Part("x", "x", (), 10, lambda out: [sys.executable, str(script), "3"])
    fail = gpu_check.Part("y", "y", (), 10, lambda out: [sys.executable, str(script), "1"])
    assert gpu_check.run_part(skip, tmp_path, {}, 30).status == "skipped: no ncu on this machine"
    assert gpu_check.run_part(fail, tmp_path, {}, 30).status == "failed (exit 1)"
    assert "== y failed (exit 1); its stderr ends:\nno ncu on this machine" in capsys.readouterr().out


def test_ncu_details_are_parsed_per_attention_launch() -> None:
    spec = importlib.util.spec_from_file_location("ncu_attention", ROOT / "benchmarks" / "ncu_attention.py")
    assert spec is not None and spec.loader is not None
    ncu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu)
    header = '"ID","Process ID","Kernel Name","Block Size","Grid Size","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = [
        '"0","1","_ragged_paged_attention_kernel","(128, 1, 1)","(288, 8, 1)","GPU Speed Of Light Throughput","DRAM Throughput","%","61.20"',
        '"0","1","_ragged_paged_attention_kernel","(128, 1, 1)","(288, 8, 1)","GPU Speed Of Light Throughput","Duration","us","612.5"',
        '"1","1","_combine_kv_splits_kernel","(32, 1, 1)","(4, 32, 1)","GPU Speed Of Light Throughput","DRAM Throughput","%","5"',
        '"2","1","_ragged_paged_attention_kernel","(128, 1, 1)","(432, 2, 1)","Occupancy","Achieved Occupancy","%","20.1"',
    ]
    text = "launched 32/8x128 decode-heavy\n==PROF== Disconnected\n" + "\n".join([header, *rows])
    launches = ncu.parse_details(text, ["32/8x128 decode-heavy", "14/2x64 decode-heavy"])
    assert [(x["label"], x["grid"], x["metrics"]) for x in launches] == [
        ("32/8x128 decode-heavy", "(288, 8, 1)", {"DRAM Throughput": "61.20 %", "Duration": "612.5 us"}),
        ("14/2x64 decode-heavy", "(432, 2, 1)", {"Achieved Occupancy": "20.1 %"}),
    ]
    assert ncu.parse_details("no csv here", []) == []


def test_nothing_run_is_nothing_met() -> None:
    rows = gpu_check.goal_rows({})
    assert rows and all(r["verdict"] == "not run" and r["figure"] == "not run" for r in rows)


@pytest.mark.parametrize("xml, want", [
    ('<testsuites><testsuite tests="5" failures="1" errors="1" skipped="2"/></testsuites>',
     {"passed": 1, "failed": 2, "skipped": 2}),
    ('<testsuite tests="3" failures="0" errors="0" skipped="0"/>', {"passed": 3, "failed": 0, "skipped": 0}),
])
def test_junit_counts(tmp_path: Path, xml: str, want: dict) -> None:
    path = tmp_path / "r.xml"
    path.write_text(xml)
    assert gpu_check.junit_counts(path) == want


def test_the_optional_kernel_sweep_runs_only_when_named_and_unknown_parts_are_refused() -> None:
    assert [p.name for p in gpu_check.OPTIONAL_PARTS] == ["kernel-sweep"]
    sweep = gpu_check.OPTIONAL_PARTS[0]
    assert all(m in gpu_check.PACKAGES for m in sweep.needs)
    command = sweep.command(Path("out.json"))
    assert "--sweep" in command and "--write-table" in command and "kernel-sweep" not in [p.name for p in gpu_check.PARTS]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--parts", "model,no-such-part"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "unknown parts: no-such-part" in done.stderr


def test_the_sweep_rows_report_the_best_config_over_the_default() -> None:
    figures = {"shapes": {"14/2x64": {"scenarios": {
        "decode-heavy": {"sweep": {"speedup": 1.31, "config": {"block_m": 16}, "best_splits": 4}}, "mixed": {}}}}}
    rows = gpu_check.goal_rows({"kernel-sweep": gpu_check.Outcome("ok", 1.0, figures)})
    sweep = [r for r in rows if r["measure"].startswith("kernel sweep")]
    assert [r["measure"] for r in sweep] == ["kernel sweep 14/2x64 decode-heavy: best config / default",
                                             "kernel sweep 14/2x64 mixed: best config / default"]
    assert sweep[0]["figure"] == "1.31 ({'block_m': 16}), 4 splits" and sweep[1]["figure"] == "not run"
    assert (sweep[0]["verdict"], sweep[1]["verdict"]) == ("reported", "not run")


def test_the_table_writer_picks_per_phase_the_config_best_over_its_scenarios(tmp_path: Path) -> None:
    bench = _kernel_bench()
    from kvmesh.kernels.attention_configs import AttentionConfig, ConfigTable, SplitKVPolicy, defaults_table

    a, b = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}, {"block_m": 16, "block_n": 128,
                                                                          "num_warps": 8, "num_stages": 3}
    c = {**b, "num_stages": 4}  # timed in one scenario only: not a candidate
    sweeps = {
        "decode-heavy": {"sweep": {"timings": [[a, 1.0], [b, 0.7], [c, 0.1]], "policy_ms": {1: 1.0, 2: 0.8, 4: 0.9, 8: 1.2}}},
        "decode-small-batch": {"sweep": {"timings": [[a, 2.0], [b, 2.2]], "policy_ms": {1: 2.0, 2: 1.9, 4: 1.5, 8: 1.6}}},
        "prefill-heavy": {"sweep": {"timings": [[{**a, "block_m": 64}, 5.0]]}},
        "mixed": {},
    }
    figures = {"shapes": {"14/2x64": {"scenarios": sweeps}}}
    table = bench.tuned_table(defaults_table(), figures, "bf16", "NVIDIA H100 80GB HBM3", "2026-12-01")
    assert table.configs[(64, 7, "decode", "bf16")] == AttentionConfig(**b)  # 0.7 x 1.1 < 1 x 1
    assert table.tuned_on[(64, 7, "decode", "bf16")] == "NVIDIA H100 80GB HBM3 2026-12-01"
    assert table.configs[(64, 7, "prefill", "bf16")] == AttentionConfig(64, 64)  # the default won
    assert (64, 4, "decode", "bf16") not in table.tuned_on  # shapes not swept keep their defaults
    assert table.split_kv == SplitKVPolicy(programs_per_sm=4)  # 2.4 s in all, the least
    path = tmp_path / "table.json"
    bench.write_table(path, table)
    assert ConfigTable.from_json(json.loads(path.read_text())) == table


def _kernel_bench():
    spec = importlib.util.spec_from_file_location("kernel_bench", ROOT / "benchmarks" / "kernel_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["kernel_bench"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


def test_the_sweep_tries_the_defaults_neighbours_first() -> None:
    spec = importlib.util.spec_from_file_location("kernel_bench", ROOT / "benchmarks" / "kernel_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["kernel_bench"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    from kvmesh.kernels.triton_attention import AttentionConfig

    default = AttentionConfig(16, 64, 4, 2)
    order = bench.sweep_candidates(default, decode=True)
    assert len(order) == len(set(order)) == 72 and order[0] == default

    def distance(c) -> int:
        return sum(a != b for a, b in zip((c.block_m, c.block_n, c.num_warps, c.num_stages), (16, 64, 4, 2), strict=True))

    assert [distance(c) for c in order] == sorted(distance(c) for c in order)
    assert {c.block_m for c in bench.sweep_candidates(AttentionConfig(64, 64), decode=False)} == {32, 64, 128}
    small_head = bench.sweep_candidates(default, decode=True, head_dim=64)  # a small head also tries 256 keys
    assert len(small_head) == 96 and {c.block_n for c in small_head} == {32, 64, 128, 256}


SWEEP_ON_CPU = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("kernel_bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
sys.modules["kernel_bench"] = bench
spec.loader.exec_module(bench)
from kvmesh.kernels.reference import ragged_paged_attention_ref

timed = []
def fake_ms(fn):
    timed.append(fn())  # the kernel runs: a launch it cannot make raises here
    return 1.0 + len(timed)
bench._time_ms = fake_ms
gen = torch.Generator().manual_seed(0)
k, v = (torch.randn(8, 4, 2, 16, generator=gen) for _ in range(2))
batch = {"q": torch.randn(2, 4, 16, generator=gen), "k": k, "v": v,
         "cu": torch.tensor([0, 1, 2], dtype=torch.int32), "kv": torch.tensor([9, 5], dtype=torch.int32),
         "table": torch.tensor([[3, 1, 6], [2, 5, 0]], dtype=torch.int32)}
result = bench._sweep(batch, bench.Scenario("tiny-decode", [(1, 9), (1, 5)]), 0.25, default_ms=2.0, budget_s=0.0)
assert result["tried"] == 1 and result["config"]["block_m"] == 16, result  # the default: a 16-row decode tile
assert sorted(result["splits_ms"]) == [1, 2, 4, 8, 16] and result["best_splits"] == 1, result
want = ragged_paged_attention_ref(batch["q"], k, v, batch["cu"], batch["kv"], batch["table"], 0.25)
for out in timed:  # every launch the sweep timed computed the attention
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
print("swept", len(timed))
"""


def test_the_sweep_loop_times_the_default_first_then_split_counts() -> None:
    """The sweep's loop on the CPU (Triton's interpreter, set before triton is imported, so in a
    process of its own; one tiny decode batch): with no budget left it still times the default, then
    every split count; ``_time_ms`` stands in for do_bench, which needs CUDA."""
    done = subprocess.run([sys.executable, "-c", SWEEP_ON_CPU, str(ROOT / "benchmarks" / "kernel_bench.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("swept 10")  # the default, 5 split counts, 4 policies

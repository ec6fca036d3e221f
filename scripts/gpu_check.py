"""`make gpu-check`: the GPU worker's figures, in one command, on a machine with an NVIDIA GPU, torch,
triton and CUDA but no internet. It installs nothing.

It checks its imports first and names what is missing (and which parts then cannot run), refuses
cleanly without CUDA, then runs, each part in its own process under a time budget (480 s in all by
default, on one H100 / H200; a part that fails prints why, a part left without time says so):

0. model: the 1B Llama shape (16 layers, 2048 wide, 32/8 heads, MLP 8192, vocab 128,256) and the
   Qwen2-0.5B shape (24 layers, 896 wide, 14/2 heads of 64, vocab 151,936, tied), made once;
1. cuda-tests: ``pytest -m cuda tests/kernels tests/model_worker`` (4 processes with pytest-xdist);
2. kernel-bench: ``benchmarks/kernel_bench.py --shapes all`` (Triton attention vs torch SDPA, bf16, every
   served head shape, and the device's copy bandwidth);
3. decode-1b: ``benchmarks/decode_profile.py``: wall, GPU-busy time and launches per decode step, 1B
   shape, batch 1 / 16 / 64 at 128 and 2,048 tokens of context, compiled + CUDA graphs;
4. decode-qwen: the same on the Qwen2-0.5B shape at batch 1 and 128;
5. multistep: ``benchmarks/multistep_bench.py`` on the 1B shape, warm, MS-1 and MS-8;
6. warm-start: ``benchmarks/warm_start_bench.py``: first TTFT after ready over warm TTFT;
7. mesh: ``benchmarks/mesh_bench.py``: the whole mesh, 2 workers at --memory-fraction 0.4 started together,
   kv-aware vs round-robin, under cache pressure and without;
8. host-tier: ``benchmarks/host_tier_bench.py --one-engine``: host-hit / device-hit TTFT, 512 and 2,048-token
   prefixes (the tier's CUDA path: pinned memory, a copy stream);
9. ncu: ``benchmarks/ncu_attention.py``: Nsight Compute on the attention's decode batches (skipped, with
   the reason, where ncu is absent).

Optional (``--parts kernel-sweep``): ``kernel_bench.py --shapes all --sweep --write-table``: launch configs,
split counts and the split policy per head shape within a time budget, written into
kernels/attention_configs.json (the committed table; review the diff).

It prints one table (issue 43's goals, met / not met / not run) and writes every figure to
``--json`` (default gpu-check.json). Without an installed kvmesh (a source copy) it lays the
package out as the wheel does (links in a temp dir) and runs every part with that on PYTHONPATH.

Run: make gpu-check   (or: python3 scripts/gpu_check.py [--json OUT] [--parts a,b] [--budget-s 480])
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# import name -> the package pip installs it from
PACKAGES = {
    "torch": "torch", "triton": "triton", "numpy": "numpy", "safetensors": "safetensors",
    "tokenizers": "tokenizers", "transformers": "transformers", "pytest": "pytest",
    "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis", "xxhash": "xxhash", "msgpack": "msgpack",
    "jinja2": "jinja2", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection", "google.protobuf": "protobuf", "redis": "redis",
    "prometheus_client": "prometheus-client", "uvloop": "uvloop", "fastapi": "fastapi", "uvicorn": "uvicorn",
    "aiohttp": "aiohttp", "ijson": "ijson", "zmq": "pyzmq",
}
ENGINE = ("torch", "triton", "numpy", "safetensors", "tokenizers", "transformers", "xxhash", "jinja2")
SERVICES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "prometheus_client", "uvloop",
            "fastapi", "uvicorn", "aiohttp", "ijson", "msgpack")


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    needs: tuple[str, ...]
    """Imports it needs; ``redis-server`` (a binary) where the mesh needs it."""
    budget_s: float
    command: Callable[[Path], list[str]]
    """The command, given where its JSON goes."""


def _bench(script: str, *args: str) -> Callable[[Path], list[str]]:
    return lambda out: [sys.executable, str(ROOT / "benchmarks" / script), *args, "--json", str(out)]


def _pytest_cuda(out: Path) -> list[str]:
    xdist = ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []
    return [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *xdist,
            "tests/kernels", "tests/model_worker", f"--junitxml={out.with_suffix('.xml')}"]


def _make_models(out: Path) -> list[str]:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from decode_profile import model_dir; "
            f"json.dump({{'1b': model_dir('1b'), 'qwen05': model_dir('qwen05')}}, open({str(out)!r}, 'w'))")
    return [sys.executable, "-c", code]


PARTS = [
    Part("model", "the 1B Llama and Qwen2-0.5B shapes, made once (cached under $KVMESH_CACHE_DIR)", ENGINE, 90,
         _make_models),
    Part("cuda-tests", "the CUDA tests (pytest -m cuda tests/kernels tests/model_worker)",
         (*ENGINE, "pytest", "pytest_timeout", "hypothesis"), 200, _pytest_cuda),
    Part("kernel-bench", "Triton attention vs torch SDPA (bf16), every served head shape; copy bandwidth",
         ("torch", "triton"), 90, _bench("kernel_bench.py", "--dtype", "bf16", "--shapes", "all")),
    Part("decode-1b", "decode step, 1B shape, batch 1/16/64 at 128 and 2,048 tokens of context, graphs", ENGINE, 90,
         _bench("decode_profile.py", "--model", "1b", "--batches", "1,16,64", "--prompt-lens", "128,2048",
                "--modes", "graphs", "--steps", "20")),
    Part("decode-qwen", "decode step, Qwen2-0.5B shape, batch 1 and 128, graphs", ENGINE, 70,
         _bench("decode_profile.py", "--model", "qwen05", "--batches", "1,128", "--modes", "graphs", "--steps", "20")),
    Part("multistep", "multistep_bench on the 1B shape: MS-1 and MS-8, warm", ENGINE, 75,
         _bench("multistep_bench.py", "--model", "1b", "--steps", "1,8", "--num-requests", "64", "--prompt-len",
                "128", "--output-len", "128", "--device", "cuda")),
    Part("warm-start", "first TTFT after ready / warm TTFT, with the warm-up", ENGINE, 75,
         _bench("warm_start_bench.py", "--model", "1b", "--configs", "default", "--device", "cuda", "--starts", "1",
                "--warm-only")),
    Part("mesh", "the whole mesh on one GPU: 2 workers at 0.4 started together, kv-aware vs round-robin",
         (*ENGINE, *SERVICES, "redis", "redis-server"), 120, _bench("mesh_bench.py", "--model", "1b", "--device", "cuda")),
    Part("host-tier", "host-hit / device-hit TTFT, 512 and 2,048-token prefixes, one warm engine", ENGINE, 75,
         _bench("host_tier_bench.py", "--model", "1b", "--device", "cuda", "--ttft-only", "--one-engine",
                "--prefix-lens", "512,2048", "--repeats", "3")),
    Part("ncu", "Nsight Compute on the attention's decode batches (32/8 x 128, 14/2 x 64)", ("torch", "triton"), 75,
         _bench("ncu_attention.py", "--shapes", "32/8x128,14/2x64", "--scenarios", "decode-heavy")),
]

OPTIONAL_PARTS = [
    Part("kernel-sweep", "the Triton attention's launch configs, split counts and policy per head shape, 10 s a "
         "scenario, written into kernels/attention_configs.json", ("torch", "triton"), 300,
         _bench("kernel_bench.py", "--dtype", "bf16", "--shapes", "all", "--no-baselines", "--sweep",
                "--sweep-budget-s", "10", "--write-table", str(ROOT / "kernels" / "attention_configs.json"))),
]
"""Run only when ``--parts`` names them (not by ``make gpu-check``): ``--parts kernel-sweep``."""

SKIP_EXIT = 3
"""A part's script exits with this when what it needs is absent (ncu): the part is skipped, with its reason."""


def missing(modules: Iterable[str], find: Callable[[str], object | None] | None = None,
            which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """The modules (and the ``redis-server`` binary) that cannot be found, in order."""
    def found(name: str) -> bool:
        if name == "redis-server":
            return which(name) is not None
        try:
            return (find or importlib.util.find_spec)(name) is not None
        except (ImportError, ValueError):  # a parent package is missing
            return False

    return [m for m in dict.fromkeys(modules) if not found(m)]


def describe_missing(absent: Sequence[str]) -> str:
    """One line naming what to install (pip names) and the binaries."""
    mods = [m for m in absent if m != "redis-server"]
    parts = []
    if mods:
        parts.append("pip packages " + ", ".join(PACKAGES.get(m, m) for m in mods) + f" (imports {', '.join(mods)})")
    if "redis-server" in absent:
        parts.append("the redis-server binary")
    return "missing: " + "; ".join(parts) if parts else "nothing missing"


def cuda_refusal(cuda_available: bool, torch_found: bool) -> str | None:
    """Why this machine cannot run the check, or None."""
    if not torch_found:
        return "gpu-check: torch is not importable; it needs an NVIDIA GPU with torch, triton and CUDA"
    if not cuda_available:
        return ("gpu-check: no CUDA device (torch.cuda.is_available() is False): it measures the GPU worker and "
                "needs an NVIDIA GPU with CUDA; on a CPU machine run `make test` and `make bench` instead")
    return None


def source_tree_env(root: Path, importable: bool) -> dict[str, str]:
    """Environment for the parts: nothing when kvmesh is installed; otherwise the package laid out
    as the wheel lays it (pyproject's package-dir: links in a temp dir) first on PYTHONPATH, and the
    checkout (tests, benchmarks) after it, without the current directory (``PYTHONSAFEPATH``)."""
    if importable:
        return {}
    staged = Path(tempfile.mkdtemp(prefix="kvmesh-gpu-check-"))
    pkg = staged / "kvmesh"
    pkg.mkdir()
    for entry in (root / "kvmesh").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in _package_dirs(root).items():
        sub = name.removeprefix("kvmesh.")
        if "." not in sub and not (pkg / sub).exists():
            (pkg / sub).symlink_to(root / folder)
    path = [str(staged), str(root), str(root / "benchmarks"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONSAFEPATH": "1"}


def _package_dirs(root: Path) -> dict[str, str]:
    """pyproject's [tool.setuptools.package-dir] (the services' folders inside ``kvmesh``)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the mapping as pyproject.toml has it
        return {"kvmesh.router": "router", "kvmesh.kv_service": "kv_service", "kvmesh.model_worker": "model_worker",
                "kvmesh.kernels": "kernels", "kvmesh.bridge": "bridge"}
    data = tomllib.loads((root / "pyproject.toml").read_text())
    return {k: v for k, v in data["tool"]["setuptools"]["package-dir"].items() if k != "kvmesh"}


@dataclass
class Outcome:
    status: str
    """ok | failed (exit N) | timed out | skipped: why"""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    tail: str = ""


def run_part(part: Part, out_dir: Path, env: dict[str, str], timeout: float) -> Outcome:
    out = out_dir / f"{part.name}.json"
    start = time.monotonic()
    try:
        proc = subprocess.run(part.command(out), cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        print(f"== {part.name} timed out after {timeout:.0f} s; its output ends:\n{tail}", flush=True)
        # NOTE: what it wrote before the cut (kernel_bench writes after every shape) still counts.
        try:
            figures = json.loads(out.read_text()) if out.exists() else {}
        except json.JSONDecodeError:
            figures = {}
        return Outcome("timed out", time.monotonic() - start, figures, tail=tail)
    seconds = time.monotonic() - start
    print(proc.stdout[-6000:], end="", flush=True)
    try:
        figures = json.loads(out.read_text()) if out.exists() else {}
    except json.JSONDecodeError:
        figures = {}
    if part.name == "cuda-tests":
        figures = junit_counts(out.with_suffix(".xml"))
    if proc.returncode == SKIP_EXIT:
        reason = (proc.stderr.strip().splitlines() or ["(no reason given)"])[-1]
        return Outcome(f"skipped: {reason}", seconds, figures, proc.stderr[-3000:])
    if proc.returncode != 0:
        # NOTE: a failed part says why: the end of what it wrote to stderr.
        print(f"== {part.name} failed (exit {proc.returncode}); its stderr ends:\n{proc.stderr[-3000:]}", flush=True)
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    return Outcome(status, seconds, figures, (proc.stdout + proc.stderr)[-3000:])


def junit_counts(xml: Path) -> dict[str, int]:
    """Passed / failed / skipped from pytest's JUnit XML (empty when there is none)."""
    if not xml.exists():
        return {}
    import xml.etree.ElementTree as ET

    suites = ET.parse(xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    if suite is None:
        return {}
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"] + n["errors"],
            "skipped": n["skipped"]}


def _verdict(value: float | None, goal: float, at_most: bool) -> str:
    if value is None:
        return "not run"
    return "met" if (value <= goal if at_most else value >= goal) else "not met"


REPORTED = "(reported)"
"""The goal of a row that has none: a figure to read (verdict "reported")."""


def _row64(mode: dict, prompt: int, batch: int) -> dict | None:
    prompts = mode.get("prompts") or {}
    row = (prompts.get(str(prompt)) or {}).get(str(batch))
    if row is None and prompt == 128:
        row = (mode.get("batches") or {}).get(str(batch)) or (mode.get("batches") or {}).get(batch)
    return row


def goal_rows(results: dict[str, Outcome]) -> list[dict]:
    """Issue 43's goal table from the parts' figures: measure, figure, goal, verdict."""
    rows: list[dict] = []

    def figures(name: str) -> dict:
        o = results.get(name)
        # NOTE: a part cut by its time budget keeps what it measured before (kernel-bench per shape).
        return o.figures if o is not None and o.status in ("ok", "timed out") else {}

    def add(measure: str, value: float | None, text: str, goal: str, goal_value: float, at_most: bool) -> None:
        verdict = _verdict(value, goal_value, at_most)
        if goal == REPORTED and value is not None:
            verdict = "reported"
        rows.append({"measure": measure, "figure": text if value is not None else "not run", "value": value,
                     "goal": goal, "verdict": verdict})

    kernel = figures("kernel-bench")
    shapes = kernel.get("shapes") or ({f"{kernel.get('heads')}/{kernel.get('kv_heads')}x{kernel.get('head_dim')}":
                                       kernel} if kernel.get("scenarios") else {})
    for name, shape in shapes.items():
        ratios = {sc: row.get("triton_over_sdpa") for sc, row in shape.get("scenarios", {}).items()}
        known = [r for r in ratios.values() if r is not None]
        worst = min(known) if known and len(known) == len(ratios) else None
        add(f"Triton / SDPA, {name}: prefill / decode / mixed / small-batch", worst,
            " / ".join(f"{r:.2f}" if r is not None else "-" for r in ratios.values()), ">= 0.90 each", 0.9, False)
    copy_gbps = kernel.get("copy_gbps")
    decode = ((shapes.get("32/8x128") or {}).get("scenarios") or {}).get("decode-heavy", {}).get("triton", {})
    frac = decode["gbps"] / copy_gbps if decode.get("gbps") and copy_gbps else None
    add("decode-heavy bandwidth, 32/8 x 128, bf16 / copy bandwidth", frac,
        f"{frac:.2f} ({decode['gbps']:,.0f} of {copy_gbps:,.0f} GB/s)" if frac else "", ">= 0.85", 0.85, False)

    graphs = figures("decode-1b").get("modes", {}).get("graphs", {})
    b64 = _row64(graphs, 128, 64)
    wall = b64.get("wall_ms") if b64 else None
    add("decode step, batch 64, 1B shape, prompt 128, wall", wall,
        f"{wall:.2f} ms (GPU busy {b64.get('gpu_busy_ms', float('nan')):.2f} ms)" if wall else "", "<= 1.5 ms", 1.5,
        True)
    launches = b64.get("launches") if b64 else None
    add("kernel launches per decode step (graph replay = 1)", launches,
        f"{launches:.0f}" if launches is not None else "", REPORTED, float("inf"), True)
    long = _row64(graphs, 2048, 64)
    bound = None
    if long and copy_gbps:
        bound = (long["weight_bytes"] + long["kv_bytes"]) / (copy_gbps * 1e6)  # ms
    ratio = long["wall_ms"] / bound if long and bound else None
    add("decode step, 1B shape, 64 x 2,048 context / (weights + KV) at copy bandwidth", ratio,
        f"{ratio:.2f} ({long['wall_ms']:.2f} ms vs {bound:.2f} ms; GPU busy {long.get('gpu_busy_ms', float('nan')):.2f})"
        if ratio else "", "<= 1.15", 1.15, True)
    qwen = _row64(figures("decode-qwen").get("modes", {}).get("graphs", {}), 128, 128)
    wall = qwen.get("wall_ms") if qwen else None
    add("decode step, Qwen2-0.5B shape, batch 128, wall", wall,
        f"{wall:.2f} ms (GPU busy {qwen.get('gpu_busy_ms', float('nan')):.2f} ms)" if wall else "", "<= 1.2 ms", 1.2,
        True)
    steps = figures("multistep").get("steps", {})
    tok_s = max((r["tok_s"] for r in steps.values()), default=None)
    add("output tok/s, 64 requests x 128 out, best MS", tok_s,
        ", ".join(f"MS-{n} {r['tok_s']:,.0f}" for n, r in steps.items()), ">= 40,000", 40_000, False)
    warm = figures("warm-start").get("configs", {}).get("default", {})
    ratio = warm.get("with_warmup", {}).get("ratio")
    add("TTFT of the first request after ready / warm TTFT", ratio,
        f"{ratio:.2f} ({warm['with_warmup']['first_ttft_ms']:.1f} vs {warm['with_warmup']['warm_ttft_ms']:.1f} ms)"
        if ratio else "", "<= 1.5", 1.5, True)
    mesh = figures("mesh").get("workloads", {})
    served = [p for w in mesh.values() for p in w.get("policies", {}).values()]
    both = (1.0 if len(mesh) == 2 and all(p["failed"] == 0 and p["completed"] > 0 for p in served) else 0.0) \
        if served else None
    add("2 workers at 0.4 started together, both mesh workloads", both,
        ("both serve, 0 failed" if both else "a worker failed or a workload did not run") if served else "",
        "both serve", 1.0, False)
    for name, w in mesh.items():
        r = w.get("kv_aware_over_round_robin")
        add(f"mesh {name}: kv-aware / round-robin req/s", r, f"{r:.2f}" if r else "", REPORTED, 0.0, False)
    for n, row in figures("host-tier").get("prefixes", {}).items():
        r = row.get("host_over_device") if row.get("host_hits_served") else None
        add(f"host-hit / device-hit TTFT, {n}-token prefix", r,
            f"{r:.2f} ({row['host_ms']:.1f} vs {row['device_ms']:.1f} ms; recomputed {row['recomputed_ms']:.1f})"
            if r else "", "<= 2.0", 2.0, True)
    for launch in figures("ncu").get("launches", []):
        m = launch.get("metrics", {})
        dram = m.get("DRAM Throughput")
        value = float(dram.split()[0].replace(",", "")) if dram else None
        add(f"ncu {launch.get('label', '?')}: DRAM throughput (% of peak)", value,
            ", ".join(f"{k} {m[k]}" for k in ("DRAM Throughput", "Duration", "Achieved Occupancy",
                                               "Registers Per Thread") if k in m), REPORTED, 0.0, False)
    for name, shape in figures("kernel-sweep").get("shapes", {}).items():
        for sc, row in shape.get("scenarios", {}).items():
            sweep = row.get("sweep") or {}
            r = sweep.get("speedup")
            add(f"kernel sweep {name} {sc}: best config / default", r,
                f"{r:.2f} ({sweep['config']})" + (f", {sweep['best_splits']} splits" if "best_splits" in sweep else "")
                if r else "", REPORTED, 0.0, False)
    tests = figures("cuda-tests")
    failed = tests.get("failed") if tests else None
    add("CUDA tests (kernels + model_worker, -m cuda)", failed,
        f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped" if tests else "",
        "all pass", 0, True)
    return rows


def format_table(rows: list[dict], outcomes: dict[str, Outcome]) -> str:
    width = max(len(r["measure"]) for r in rows)
    lines = [f"{'measure':<{width}}  {'figure':<48}  {'goal':<11}  verdict", "-" * (width + 75)]
    lines += [f"{r['measure']:<{width}}  {r['figure']:<48}  {r['goal']:<11}  {r['verdict']}" for r in rows]
    lines.append("")
    lines += [f"part {name:<15} {o.status:<24} {o.seconds:6.0f} s" for name, o in outcomes.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gpu-check.json", help="every figure (default gpu-check.json)")
    ap.add_argument("--parts", default=",".join(p.name for p in PARTS),
                    help="comma-separated parts to run, in this order (default: all but the optional kernel-sweep)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for all parts (default 480)")
    args = ap.parse_args(argv)
    names = args.parts.split(",")
    unknown = set(names) - {p.name for p in (*PARTS, *OPTIONAL_PARTS)}
    if unknown:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")
    wanted = [p for p in (*PARTS, *OPTIONAL_PARTS) if p.name in names]
    absent = missing(m for p in wanted for m in p.needs)
    print(f"gpu-check imports: {describe_missing(absent)}", flush=True)
    torch_found = "torch" not in absent
    cuda = False
    if torch_found:
        import torch

        cuda = torch.cuda.is_available()
    refusal = cuda_refusal(cuda, torch_found)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    import torch

    kvmesh_importable = importlib.util.find_spec("kvmesh") is not None and _has_services()
    env = source_tree_env(ROOT, kvmesh_importable)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": _version("triton"), "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    print(f"gpu-check on {machine['gpu']}: torch {machine['torch']}, triton {machine['triton']}, CUDA "
          f"{machine['cuda']}, Python {machine['python']}", flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="kvmesh-gpu-check-out-"))
    deadline = time.monotonic() + args.budget_s
    outcomes: dict[str, Outcome] = {}
    for part in wanted:
        lacking = missing(part.needs)
        left = deadline - time.monotonic()
        if lacking:
            outcomes[part.name] = Outcome(f"skipped: {describe_missing(lacking)}")
        elif left < 20:
            outcomes[part.name] = Outcome("skipped: no time left")
        else:
            print(f"\n== {part.name}: {part.what} (up to {min(part.budget_s, left):.0f} s)", flush=True)
            outcomes[part.name] = run_part(part, out_dir, env, min(part.budget_s, left))
        print(f"== {part.name}: {outcomes[part.name].status}", flush=True)
    rows = goal_rows(outcomes)
    print("\n" + format_table(rows, outcomes))
    Path(args.json).write_text(json.dumps({
        "machine": machine, "missing": absent, "goals": rows,
        "parts": {n: {"status": o.status, "seconds": o.seconds, "figures": o.figures, "tail": o.tail}
                  for n, o in outcomes.items()}}, indent=1))
    print(f"\nevery figure: {args.json}")
    return 0 if all(o.status == "ok" for o in outcomes.values()) else 1


def _has_services() -> bool:
    try:
        return importlib.util.find_spec("kvmesh.model_worker") is not None
    except ImportError:
        return False


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a version string only
        return "?"


if __name__ == "__main__":
    sys.exit(main())

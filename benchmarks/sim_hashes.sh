#!/usr/bin/env bash
# Fixed-seed `kvmesh simulate` runs and the SHA-256 of each JSON, whole and without its "settings"
# (the results alone: a new setting adds a key there): a refactor that changes no behaviour leaves every
# hash as it was (issue 33: at 3d3e82c and after the rooms, the same five hashes; issue 49 added f, P/D).
# Usage: benchmarks/sim_hashes.sh [OUTDIR]   (about 20 s; traces from ../shared/traces or $TRACES)
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvmesh
O=${1:-$(mktemp -d)}
T=${TRACES:-$(cd .. && pwd)/shared/traces}
mkdir -p "$O"
q=(--no-progress --relative-rates '')
$K simulate --trace "$T/conversation_trace.jsonl" --max-requests 300 --workers 4 \
  --policies kv-aware,round-robin,least-loaded,prefix-hash,approx-tree,dynamo,llm-d,preble,lmetric \
  --rates 1.0 --no-capacity "${q[@]}" --json "$O/a.json" > "$O/a.txt" 2>&1
$K simulate --workload shared-prefix --max-requests 400 --routers 3 --policies kv-aware,dynamo,llm-d --rates 1 \
  --no-capacity "${q[@]}" --json "$O/b.json" > "$O/b.txt" 2>&1
$K simulate --workload multi-turn --max-requests 300 --workers 4 --policies kv-aware,round-robin --rates 1 \
  --restart-at 0.5 --event-loss 0.05 --no-capacity "${q[@]}" --json "$O/c.json" > "$O/c.txt" 2>&1
$K simulate --workload hot-prompt --max-requests 200 --workers 4 --policies kv-aware,round-robin \
  --relative-rates 1 --no-progress --json "$O/d.json" > "$O/d.txt" 2>&1
$K simulate --trace "$T/synthetic_trace.jsonl" --max-requests 200 --workers 2xH100,2xA100 --routers 2 \
  --policies kv-aware,lmetric,dynamo --rates 1 --no-capacity "${q[@]}" --json "$O/e.json" > "$O/e.txt" 2>&1
$K simulate --workload multi-turn --max-requests 200 --pd 1:2 \
  --policies kv-aware+auto,kv-aware+always,kv-aware+dynamic,llm-d+pd,dynamo+pd --rates 1 --no-capacity "${q[@]}" \
  --json "$O/f.json" > "$O/f.txt" 2>&1
cd "$O" && for f in ./*.json; do
  echo "$(sha256sum < "$f" | cut -c1-64)  $(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); d.pop("settings"); print(json.dumps(d))' "$f" | sha256sum | cut -c1-16)  $f"
done

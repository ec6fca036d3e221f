#!/usr/bin/env bash
# Issue 51: goodput at the requests' own objectives (--objectives workload), kv-aware against llm-d's
# predicted-latency scheduler and its sticky-until-saturated one; 8 H100s, 1 router, fixed rates (no capacity
# search: short runs) of about half, near and past kv-aware's capacity in the matrix (benchmarks/results/sim/*.json,
# catalog/; that capacity is at the simulator's looser SLO, not these objectives). Read with `.venv/bin/python benchmarks/sim_goal_table.py` (its goodput section).
# Usage: bash benchmarks/results/sim/slo/run_slo.sh [WORKLOAD...]   (traces from ../shared/traces or $TRACES)
set -euo pipefail
cd "$(dirname "$0")/../../../.."
K=.venv/bin/kvmesh
O=benchmarks/results/sim/slo
T=${TRACES:-$(cd .. && pwd)/shared/traces}
P=kv-aware,llm-d-predicted,llm-d-sticky
q=(--no-capacity --no-limits --no-progress --relative-rates '' --jobs 1 --objectives workload --policies $P)
run() { local name=$1; shift; $K simulate "$@" "${q[@]}" --json "$O/$name.json" > "$O/$name.txt" 2>&1; }
for w in "${@:-conversation shared-prefix code-generation multi-turn hot-prompt reasoning}"; do
  for one in $w; do
    case $one in
      conversation)    run conversation --trace "$T/conversation_trace.jsonl" --max-requests 600 --rates 1,1.5,2 ;;
      shared-prefix)   run shared-prefix --workload shared-prefix --max-requests 600 --rates 1.5,2.5,3.5 ;;
      multi-turn)      run multi-turn --workload multi-turn --max-requests 600 --rates 2,3,4 ;;
      hot-prompt)      run hot-prompt --workload hot-prompt --max-requests 600 --rates 2,3,4 ;;
      reasoning)       run reasoning --workload reasoning --max-requests 300 --rates 10,30,90 ;;
      code-generation) run code-generation --workload code-generation --max-requests 300 --rates 4,8,12 ;;
    esac
  done
done

#!/usr/bin/env bash
# The issue-15 goal table: every command whose JSON is in this folder, in the order they were run.
# Usage: benchmarks/results/sim/run_matrix.sh [step ...]   (steps: conv3000 synthetic shared-prefix
# multi-turn hot-prompt no-reuse faults conv-all events events-rest catalog newpeers kvaware-rerun; issue 27's fleet shapes: fleet-<workload>
# for conversation synthetic shared-prefix multi-turn hot-prompt no-reuse, fleet-scale32, fleet-determinism,
# fleet-conv-all, fleet-hot3000, fleet-scale32-hot; FLEET=DIR writes them to DIR).
# Each run holds the shared heavy lock; --jobs 2.
# NOTE: the goal-table steps ran before event messages carried the workers' load; --load-reports
# heartbeat (in HB below) gives their runs again. The 'events' step is the later re-run of the
# conversation trace and its faults with the current default (load on events) into events/.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/sim
TRACES=../shared/traces
NOTE=${NOTE:-"2-core host shared with other engineers' light work; figures are virtual time"}
HB="--load-reports heartbeat"
sim() { flock /tmp/kvmesh-heavy.lock .venv/bin/kvmesh simulate --workers 8 --jobs 2 --no-progress "$@"; }
EV=$OUT/events
FL=${FLEET:-$OUT/fleet}  # FLEET=DIR: the fleet steps write there (issue 42's runs: $OUT/fleet-2026-11-27)
# 32 workers on one workload (scale): 3,000 requests, kv-aware and the peers that were within 20 % of
# it on 8 workers (issue 42: shared-prefix and hot-prompt; round-robin too, the hot prompt's best).
sim32() {
  flock /tmp/kvmesh-heavy.lock .venv/bin/kvmesh simulate --workers 32 --jobs 2 --no-progress --workload "${1:-shared-prefix}" \
    --max-requests 3000 --relative-rates '' --no-limits --policies kv-aware,approx-tree,dynamo,prefix-hash,llm-d${2:-} \
    --json "$FL/${1:-shared-prefix}_w32.json"
}
# Same seed, two processes with different hash seeds: byte-identical JSON (3 routers, every policy).
determinism() {
  for h in 1 2; do
    PYTHONHASHSEED=$h sim --workload hot-prompt --max-requests 300 --routers 3 --rates 1 --no-capacity \
      --relative-rates '' --json "/tmp/kvmesh-determinism-$h.json"
  done
  cmp /tmp/kvmesh-determinism-1.json /tmp/kvmesh-determinism-2.json && echo "determinism: byte-identical" \
    | tee "$FL/determinism.txt"
}
step() {
  case "$1" in
    conv3000)  sim $HB --trace $TRACES/conversation_trace.jsonl --max-requests 3000 --json $OUT/conversation_3000.json --plot-dir $OUT/plots/conv3000 --plot-note "$NOTE" ;;
    synthetic) sim $HB --trace $TRACES/synthetic_trace.jsonl --json $OUT/synthetic.json --plot-dir $OUT/plots/synthetic --plot-note "$NOTE" ;;
    shared-prefix|multi-turn|hot-prompt|no-reuse) sim $HB --workload "$1" --json "$OUT/$1.json" --plot-dir "$OUT/plots/$1" --plot-note "$NOTE" ;;
    faults)
      for f in "event_loss:--event-loss 0.1" "restart:--restart-at 0.5" "routers3:--routers 3"; do
        sim $HB --trace $TRACES/conversation_trace.jsonl --max-requests 3000 --policies kv-aware,round-robin \
            --relative-rates '' ${f#*:} --json "$OUT/conversation_3000_fault_${f%%:*}.json"
      done ;;
    events)
      mkdir -p $EV
      sim --trace $TRACES/conversation_trace.jsonl --max-requests 3000 --json $EV/conversation_3000.json \
          --plot-dir $EV/plots/conv3000 --plot-note "$NOTE"
      for f in "event_loss:--event-loss 0.1" "restart:--restart-at 0.5" "routers3:--routers 3" \
               "routers3_t0.1:--routers 3 --router-temperature 0.1" "t0.1:--router-temperature 0.1"; do
        sim --trace $TRACES/conversation_trace.jsonl --max-requests 3000 --policies kv-aware,round-robin \
            --relative-rates '' ${f#*:} --json "$EV/conversation_3000_fault_${f%%:*}.json"
      done ;;
    # NOTE: the whole trace (12,031 requests) takes 4x a 3,000-request step and there was not the
    # time for every policy: kv-aware against the best other on the first 3,000 (lmetric), the
    # capacity search and a run at rate 0.5 (<= half capacity) each.
    # The goal table's other workloads again with load on events (second session), into events/.
    events-rest)
      mkdir -p $EV
      sim --trace $TRACES/synthetic_trace.jsonl --json $EV/synthetic.json --plot-dir $EV/plots/synthetic --plot-note "$NOTE"
      for w in shared-prefix multi-turn hot-prompt no-reuse; do
        sim --workload "$w" --json "$EV/$w.json" --plot-dir "$EV/plots/$w" --plot-note "$NOTE"
      done ;;
    # (run in the second session, with load on events: into events/)
    conv-all)  mkdir -p $EV
               sim --trace $TRACES/conversation_trace.jsonl --policies kv-aware,lmetric --relative-rates '' \
                 --rates 0.5 --json $EV/conversation_all.json --plot-dir $EV/plots/conv-all --plot-note "$NOTE" ;;
    # Issue 51: inference-perf's catalog workloads (kvmesh/sim/workload.py), 300 requests each, the peers
    # of issue 27's table; into catalog/ (sim_goal_table.py prints them after the workloads above).
    catalog)
      mkdir -p $OUT/catalog
      for w in code-generation reasoning; do
        sim --workload "$w" --max-requests 300 --no-limits \
          --policies kv-aware,round-robin,prefix-hash,approx-tree,dynamo,llm-d,preble,lmetric --json "$OUT/catalog/$w.json"
      done
      # 300 reasoning requests never load the fleet (every policy reaches the search's ceiling): 1,000 at fixed rates
      sim --workload reasoning --max-requests 1000 --no-capacity --relative-rates '' --rates 2,4 --no-limits \
        --policies kv-aware,round-robin,prefix-hash,approx-tree,dynamo,llm-d,preble,lmetric \
        --json "$OUT/catalog/reasoning_1000_fixed_rates.json" ;;
    # Issue 51: the new peers (llm-d's sticky-until-saturated, both scorers, and its predicted-latency
    # scheduler) beside kv-aware on the 1-router shape of the fleet steps below (same flags, so the
    # other peers' figures there stand: no policy they run changed), and on the catalog's workloads.
    newpeers)
      mkdir -p $OUT/newpeers
      P=kv-aware,llm-d-sticky,llm-d-sticky-decode,llm-d-predicted
      for w in conversation synthetic shared-prefix multi-turn hot-prompt no-reuse; do
        case "$w" in
          conversation) src="--trace $TRACES/conversation_trace.jsonl" ;;
          synthetic)    src="--trace $TRACES/synthetic_trace.jsonl" ;;
          *)            src="--workload $w" ;;
        esac
        sim $src --max-requests 1000 --relative-rates '' --routers 1 --policies $P --json "$OUT/newpeers/${w}_r1.json" \
          || echo "FAILED RUNS in $OUT/newpeers/${w}_r1.json"
      done
      for w in code-generation reasoning; do
        sim --workload "$w" --max-requests 300 --no-limits --policies $P --json "$OUT/newpeers/$w.json" \
          || echo "FAILED RUNS in $OUT/newpeers/$w.json"
      done ;;
    # Issue 51, round three (a change to kv-aware's rule only: the peers' code and inputs are unchanged, and one
    # peer per trace rerun on the new code gives its old figure): kv-aware alone on every fleet shape, the catalog's
    # workloads and 32 workers, into fleet-2026-11-29-kv-aware/; then one folder with every policy's latest run
    # (merge_runs.py: issue 42's sweeps, the new peers, this) read by sim_goal_table.py --fleet.
    kvaware-rerun)
      K=$OUT/fleet-2026-11-29-kv-aware; mkdir -p $K
      for w in conversation synthetic shared-prefix multi-turn hot-prompt no-reuse; do
        case "$w" in
          conversation) src="--trace $TRACES/conversation_trace.jsonl" ;;
          synthetic)    src="--trace $TRACES/synthetic_trace.jsonl" ;;
          *)            src="--workload $w" ;;
        esac
        for shape in "r1:--routers 1" "r3:--routers 3 --no-limits" "r8:--routers 8 --no-limits" \
                     "hetero:--workers 4xH100,4xA100"; do
          sim $src --max-requests 1000 --relative-rates '' --policies kv-aware ${shape#*:} --json "$K/${w}_${shape%%:*}.json"
        done
      done
      for w in code-generation reasoning; do
        sim --workload "$w" --max-requests 300 --no-limits --policies kv-aware --relative-rates '' --json "$K/${w}_r1.json"
      done
      for w in shared-prefix hot-prompt; do
        flock /tmp/kvmesh-heavy.lock .venv/bin/kvmesh simulate --workers 32 --jobs 2 --no-progress --workload $w \
          --max-requests 3000 --relative-rates '' --no-limits --policies kv-aware --json "$K/${w}_w32.json"
      done
      sim --trace $TRACES/synthetic_trace.jsonl --max-requests 1000 --relative-rates '' --routers 1 --no-limits \
        --policies lmetric --json "$K/check_lmetric_synthetic_r1.json"  # the peer's figure stands: 2.112 in fleet-2026-11-27
      sim --trace $TRACES/synthetic_trace.jsonl --max-requests 1000 --relative-rates '' --routers 3 --no-limits \
        --policies dynamo --json "$K/check_dynamo_synthetic_r3.json"  # 2.059 in fleet-2026-11-27
      M=$OUT/fleet-2026-11-29; T=$(mktemp -d); mkdir -p $T/catalog $T/newpeers  # the catalog's runs under the fleet's names
      for w in code-generation reasoning; do
        cp $OUT/catalog/$w.json $T/catalog/${w}_r1.json; cp $OUT/newpeers/$w.json $T/newpeers/${w}_r1.json
      done
      cp $OUT/newpeers/*_r1.json $T/newpeers/
      rm -rf $M; .venv/bin/python $OUT/merge_runs.py $M $OUT/fleet-2026-11-27 $T/catalog $T/newpeers $K ;;
    # Issue 27 (roofline step time, faithful peers, shared router view; into fleet/): every workload
    # on 8 H100s with 1, 3 and 8 routers (peers in their multi-replica modes) and on a mixed fleet of
    # 4 H100 + 4 A100 behind 1 router. The first 1,000 requests of each (2 shared cores: one sweep
    # of all nine policies is ~2 min); the limits on the 1-router and mixed-fleet shapes only (they
    # do not depend on the number of routers).
    fleet-*)
      w=${1#fleet-}; mkdir -p $FL
      case "$w" in
        conversation) src="--trace $TRACES/conversation_trace.jsonl" ;;
        synthetic)    src="--trace $TRACES/synthetic_trace.jsonl" ;;
        scale32)      sim32 ; return ;;
        scale32-hot)  sim32 hot-prompt ,round-robin,lmetric ; return ;;
        # The whole conversation trace (12,031 requests): kv-aware and the best peer of its first
        # 1,000 (lmetric) behind 1 router, kv-aware behind 3 (the 2 cores allow no more).
        conv-all)     sim --trace $TRACES/conversation_trace.jsonl --policies kv-aware,lmetric --relative-rates '' \
                        --no-limits --json "$FL/conversation-all_r1.json"
                      sim --trace $TRACES/conversation_trace.jsonl --policies kv-aware --relative-rates '' \
                        --no-limits --routers 3 --json "$FL/conversation-all_r3.json" ; return ;;
        # Are the generated workloads' figures those of a burst? At 15-17x their own rate, 1,000
        # requests arrive in ~5 s. hot-prompt again with 3,000 (the three policies that matter).
        hot3000)      sim --workload hot-prompt --max-requests 3000 --policies kv-aware,prefix-hash,round-robin \
                        --relative-rates '' --no-limits --json "$FL/hot-prompt-3000_r1.json" ; return ;;
        determinism)  determinism ; return ;;
        *)            src="--workload $w" ;;
      esac
      # NOTE: a run that raises is listed under "failures" in its JSON and the command exits 1:
      # say so and go on with the other shapes.
      for shape in "r1:--routers 1" "r3:--routers 3 --no-limits" "r8:--routers 8 --no-limits" \
                   "hetero:--workers 4xH100,4xA100"; do
        sim $src --max-requests 1000 --relative-rates '' ${shape#*:} --json "$FL/${w}_${shape%%:*}.json" \
          || echo "FAILED RUNS in $FL/${w}_${shape%%:*}.json (exit $?)"
      done ;;
    *) echo "unknown step $1" >&2; exit 2 ;;
  esac
}
for s in "${@:-conv3000 synthetic shared-prefix multi-turn hot-prompt no-reuse faults conv-all}"; do
  for one in $s; do echo "== $one $(date -u +%FT%TZ)"; time step "$one"; done
done

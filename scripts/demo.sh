#!/usr/bin/env bash
# `make run`: start the local stack, send two prompts that share a long prefix, show that the
# second lands on the worker holding the prefix with cached tokens, print the index, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
KVMESH=${KVMESH:-.venv/bin/kvmesh}
LOG=$(mktemp -t kvmesh-demo.XXXXXX)

"$KVMESH" up --workers 2 "$@" >"$LOG" 2>&1 &
UP=$!
cleanup() { kill -TERM "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }
trap cleanup EXIT

echo "== starting kvmesh (kvmesh up --workers 2); log: $LOG"
for _ in $(seq 600); do
  grep -q '^ready' "$LOG" && break
  if ! kill -0 "$UP" 2>/dev/null; then cat "$LOG"; echo "kvmesh up failed" >&2; exit 1; fi
  sleep 0.5
done
grep -q '^ready' "$LOG" || { cat "$LOG"; echo "kvmesh up did not become ready" >&2; exit 1; }
sed -n '/^  /p' "$LOG"

PREFIX="You are a helpful assistant for the kvmesh project. kvmesh routes every request to the worker \
that already holds the longest cached prefix of its prompt, so a long shared system prompt like this \
one is computed once and then reused by every following request that starts with it. "
echo
echo "== request 1 (cold)"
"$KVMESH" generate --json --max-tokens 16 "${PREFIX}Question one: what is a KV cache?"
echo "== request 2 (same prefix: expect the same worker and cached_tokens > 0)"
"$KVMESH" generate --json --max-tokens 16 "${PREFIX}Question two: why route by prefix?"
echo
echo "== the same router over the OpenAI API (docs/openai.md): a chat request with curl"
MODEL=$(curl -sf http://127.0.0.1:8000/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
curl -sf http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"max_tokens\": 16, \"messages\": [{\"role\": \"system\", \"content\": \"$PREFIX\"}, {\"role\": \"user\", \"content\": \"What is a KV cache?\"}]}"
echo
echo
echo "== kvmesh admin stats"
sleep 0.5
"$KVMESH" admin stats
echo
echo "(the demo model has random weights: its text is noise; see README for a real model)"

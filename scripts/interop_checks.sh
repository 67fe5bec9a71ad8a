#!/usr/bin/env bash
# The checks of `make interop`: onboard's eval, smoke, bench and speculator acceptance against vLLM
# CPU (.venv-vllm) and against `onboard serve`, on the same models and prompts.
#
#   scripts/interop_checks.sh [eval] [smoke] [bench] [acceptance]     (default: all four)
#
# One model server is busy at a time (bench keeps two up, and loads them in turn): on 2 cores two
# torch processes at work slow each other several-fold. Results: $OUT/results/*.json, then
# scripts/interop_table.py prints the tables of docs/benchmarks.md.
#
# Environment: DEMO (the bf16 checkpoint), INTEROP_DIR (runs/interop), INTEROP_DRAFT (an EAGLE-3
# export; default $OUT/draft/speculator, else the demo run's), INTEROP_EVAL_TOKENS (512: the
# full-vocabulary answers are 49152 log-probabilities per token), INTEROP_SMOKE_PROMPTS (20),
# INTEROP_SMOKE_TOKENS (128), INTEROP_SMOKE_MODELS (bf16 fp8).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ONBOARD="$ROOT/.venv/bin/onboard"
OUT="${INTEROP_DIR:-runs/interop}"
LOGS="$OUT/logs"
RESULTS="$OUT/results"
VPORT="${INTEROP_PORT:-8011}"
OPORT="$((VPORT + 1))"
VLLM="http://127.0.0.1:$VPORT"
OWN="http://127.0.0.1:$OPORT"
mkdir -p "$LOGS" "$RESULTS"
DEMO="${DEMO:-$("$ONBOARD" demo --fetch-only | tail -n 1)}"
DRAFT="${INTEROP_DRAFT:-$OUT/draft/speculator}"
[[ -f "$DRAFT/config.json" ]] || DRAFT="runs/demo/artifact/speculator"
EVAL_ARGS=(--max-tokens "${INTEROP_EVAL_TOKENS:-512}" --window 128)
SMOKE_ARGS=(--num-prompts "${INTEROP_SMOKE_PROMPTS:-20}" --max-tokens "${INTEROP_SMOKE_TOKENS:-128}")
CHECKS="${*:-eval smoke bench acceptance}"

onboard_up() {  # MODEL NAME [serve args...]: `onboard serve` on OPORT, waiting for /health
  local model="$1" name="$2"; shift 2
  setsid "$ONBOARD" serve "$model" --port "$OPORT" --served-model-name "$name" --max-logprobs -1 "$@" \
    >"$LOGS/onboard-$name.log" 2>&1 </dev/null &
  echo $! >"$LOGS/onboard.pid"
  for _ in $(seq 1 300); do
    curl -sf "$OWN/health" >/dev/null 2>&1 && return 0
    kill -0 "$(cat "$LOGS/onboard.pid")" 2>/dev/null || { tail -n 20 "$LOGS/onboard-$name.log" >&2; return 1; }
    sleep 1
  done
  echo "onboard serve did not come up" >&2; return 1
}
onboard_down() {
  [[ -f "$LOGS/onboard.pid" ]] || return 0
  kill -TERM -- "-$(cat "$LOGS/onboard.pid")" 2>/dev/null || true
  sleep 2; rm -f "$LOGS/onboard.pid"
}
vllm_up() { scripts/interop_serve.sh "$1" "$VPORT" --served-model-name "$2" "${@:3}"; }
vllm_down() { scripts/interop_serve.sh stop "$VPORT" >/dev/null; }
trap 'onboard_down; vllm_down' EXIT

eval_endpoint() {  # RUN URL LABEL: top-20 (a lower bound) and the full vocabulary
  for k in 20 -1; do
    "$ONBOARD" eval "$1" "${EVAL_ARGS[@]}" --endpoint "$2" --top-logprobs "$k" --out "$RESULTS/eval-$3-k$k.json"
  done
}

if [[ "$CHECKS" == *eval* ]]; then
  for name in fp8 w4a4 mixed; do
    run="$OUT/$name"
    "$ONBOARD" eval "$run" "${EVAL_ARGS[@]}" --out "$RESULTS/eval-$name-inprocess.json"
    onboard_up "$run/artifact" "$name"
    eval_endpoint "$run" "$OWN" "$name-onboard"
    onboard_down
    vllm_up "$run/artifact" "$name"
    eval_endpoint "$run" "$VLLM" "$name-vllm"
    vllm_down
  done
fi

if [[ "$CHECKS" == *smoke* ]]; then
  # The reference is the local engine on the original checkpoint (the run's); bf16 is served from
  # the demo checkpoint itself, so its rates should equal the reference's.
  # vLLM CPU decodes the FP8 artifact at about 2 tokens/s (13x slower than bf16 here): CI smokes bf16 only.
  for name in ${INTEROP_SMOKE_MODELS:-bf16 fp8}; do
    model="$DEMO"; [[ "$name" == fp8 ]] && model="$OUT/fp8/artifact"
    vllm_up "$model" "$name" --max-num-seqs 16
    "$ONBOARD" smoke "$OUT/fp8" "${SMOKE_ARGS[@]}" --endpoint "$VLLM"
    cp "$OUT/fp8/endpoints/127.0.0.1_$VPORT/smoke/smoke.json" "$RESULTS/smoke-$name-vllm.json"
    vllm_down
  done
fi

if [[ "$CHECKS" == *bench* ]]; then
  vllm_up "$DEMO" bf16 --max-num-seqs 16
  onboard_up "$DEMO" bf16
  "$ONBOARD" bench "$DEMO" --endpoint "$OWN" --endpoint "$VLLM" --concurrency 1,4,16 --max-tokens 64 \
    --out "$RESULTS/bench-bf16.json"
  onboard_down
  vllm_down
fi

if [[ "$CHECKS" == *acceptance* ]]; then
  spec="{\"method\": \"eagle3\", \"model\": \"$(realpath "$DRAFT")\", \"num_speculative_tokens\": 3}"
  if vllm_up "$DEMO" bf16 --speculative-config "$spec"; then
    "$ONBOARD" speculator "$OUT/fp8" --endpoint "$VLLM"
    cp "$OUT/fp8/endpoints/127.0.0.1_$VPORT/speculator/metrics.json" "$RESULTS/acceptance-vllm.json"
    vllm_down
  else
    grep -oE '[A-Za-z]*Error: .*' "$LOGS/vllm-$VPORT.log" | tail -n 3 >"$RESULTS/acceptance-vllm-refusal.txt" || true
  fi
  onboard_up "$DEMO" bf16 --speculator "$DRAFT"
  "$ONBOARD" speculator "$OUT/fp8" --endpoint "$OWN"
  cp "$OUT/fp8/endpoints/127.0.0.1_$OPORT/speculator/metrics.json" "$RESULTS/acceptance-onboard.json"
  onboard_down
fi

.venv/bin/python scripts/interop_table.py "$RESULTS"

#!/usr/bin/env bash
# `make interop`: onboard's artifacts served by vLLM (CPU build in .venv-vllm).
#
#   scripts/interop_run.sh            prepare artifacts, serve each model and probe it, run the checks
#
# Stage 1 prepares the artifacts; stage 2 starts one vLLM server per model, probes it with one
# prompt_logprobs completion (serves or refuses) and stops it; stage 3 runs every onboard check
# against vLLM and `onboard serve` (scripts/interop_checks.sh) and the tests marked `interop`.
# Everything runs one process after another: on 2 cores a quantize beside a server (or two
# servers) slows both several-fold.
#
# Environment: DEMO (the bf16 checkpoint; default: `onboard demo --fetch-only`), INTEROP_DIR
# (default runs/interop), INTEROP_PORT (default 8011), INTEROP_REQUANTIZE=1 to redo artifacts,
# INTEROP_MODELS (space-separated subset of: bf16 fp8 w4a4 mixed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ONBOARD="$ROOT/.venv/bin/onboard"
OUT="${INTEROP_DIR:-runs/interop}"
PORT="${INTEROP_PORT:-8011}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"

DEMO="${DEMO:-$("$ONBOARD" demo --fetch-only | tail -n 1)}"
[[ -f "$DEMO/config.json" ]] || { echo "demo checkpoint not found: $DEMO" >&2; exit 1; }

# ---- stage 1: artifacts (each quantize alone on the machine) -----------------------------------
quantize() {  # NAME ONBOARD-QUANTIZE-ARGS...
  local name="$1"; shift
  if [[ -f "$OUT/$name/artifact/config.json" && "${INTEROP_REQUANTIZE:-0}" != 1 ]]; then
    echo "artifact $OUT/$name/artifact exists (INTEROP_REQUANTIZE=1 to redo)"; return
  fi
  echo "quantize $name ..."
  local t0=$SECONDS
  "$ONBOARD" quantize "$DEMO" --out "$OUT/$name" "$@" >"$LOGS/quantize-$name.log" 2>&1 \
    || { tail -n 30 "$LOGS/quantize-$name.log" >&2; exit 1; }
  echo "quantize $name: $((SECONDS - t0))s"
}
# Round to nearest: this checks how vLLM serves each format, not a method; the Llama recipe's
# AWQ+GPTQ takes ten minutes a quantize here and pushed CI past its budget.
quantize fp8 --scheme fp8 --method rtn
quantize w4a4 --scheme nvfp4 --method rtn
quantize mixed --recipe recipes/smollm2-mixed.yaml

declare -A MODEL_DIR=(
  [bf16]="$DEMO"
  [fp8]="$OUT/fp8/artifact"
  [w4a4]="$OUT/w4a4/artifact"
  [mixed]="$OUT/mixed/artifact"
)

# ---- stage 2: one server at a time -------------------------------------------------------------
# A fixed token-id prompt (SmolLM2 ids of a ChatML "What is the capital of France? Answer in one
# word." turn), so that no tokenizer differences enter the comparison.
PROMPT_IDS="[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 2229, 30, 2, 198, 1, 520, 9531, 198]"

probe() {  # NAME: one prompt_logprobs completion; the response is kept for the checks
  local name="$1" model="$2"
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": $PROMPT_IDS, \"max_tokens\": 1, \"prompt_logprobs\": 5, \"temperature\": 0}" \
    >"$LOGS/probe-$name.json"
  echo "$name: prompt_logprobs answered ($(wc -c <"$LOGS/probe-$name.json") bytes, $LOGS/probe-$name.json)"
}

run_checks() {  # NAME MODEL_DIR: the interop checks against the running server (to be extended)
  probe "$1" "$2"
}

trap 'scripts/interop_serve.sh stop "$PORT" >/dev/null 2>&1 || true' EXIT
status=0
for name in ${INTEROP_MODELS:-bf16 fp8 w4a4 mixed}; do
  model="${MODEL_DIR[$name]}"
  if ! scripts/interop_serve.sh "$model" "$PORT"; then
    echo "$name: vLLM refuses $model (see $LOGS/vllm-$PORT.log)" >&2
    cp "$LOGS/vllm-$PORT.log" "$LOGS/vllm-$name.log" 2>/dev/null || true
    status=1; continue
  fi
  run_checks "$name" "$model" || status=1
  scripts/interop_serve.sh stop "$PORT"
  cp "$LOGS/vllm-$PORT.log" "$LOGS/vllm-$name.log"
done
[[ $status == 0 ]] || exit $status

# ---- stage 3: every onboard check against vLLM and against `onboard serve` ---------------------
DEMO="$DEMO" INTEROP_DIR="$OUT" INTEROP_PORT="$PORT" scripts/interop_checks.sh
.venv/bin/python -m pytest -q -m interop tests/test_interop.py

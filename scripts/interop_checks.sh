#!/usr/bin/env bash
# The checks of `make interop`: onboard's eval, smoke, bench and speculator acceptance against vLLM
# CPU (.venv-vllm) and against `onboard serve`, on the same models and prompts, and the tests marked
# `interop`. Each server starts once and answers every check of its model:
#
#   vLLM, the demo checkpoint (bf16)        probe, smoke, bench (beside onboard serve), the agreement test
#   vLLM, the fp8 / w4a4 / mixed artifacts  probe, eval (top-20 and the full vocabulary)
#   vLLM, bf16 with the EAGLE-3 draft       speculator acceptance
#   onboard serve                           the same eval, bench and acceptance checks
#   (tests/test_interop.py's MTP test serves its own tiny artifact)
#
#   scripts/interop_checks.sh [eval] [smoke] [bench] [acceptance] [tests]     (default: all five)
#
# One model server is busy at a time (bench keeps two up, and loads them in turn): on 2 cores two
# torch processes at work slow each other several-fold. Results: $OUT/results/*.json, then
# scripts/interop_table.py prints the tables of docs/benchmarks.md; each check's time is printed.
#
# Environment: DEMO (the bf16 checkpoint), INTEROP_DIR (runs/interop), INTEROP_DEMO_RUN (runs/demo),
# INTEROP_DRAFT (an EAGLE-3 export; default $OUT/draft/speculator, else the demo run's),
# INTEROP_EVAL_TOKENS (512: the full-vocabulary answers are 49152 log-probabilities per token),
# INTEROP_SMOKE_PROMPTS (20), INTEROP_SMOKE_TOKENS (128), INTEROP_SMOKE_MODELS (bf16 fp8),
# INTEROP_MODELS (the artifacts served: fp8 w4a4 mixed), INTEROP_EVAL_TOPK (20 -1: the top-20 lower
# bound and the full vocabulary), INTEROP_BENCH_CONCURRENCY (1,4,16).
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
[[ -f "$DRAFT/config.json" ]] || DRAFT="${INTEROP_DEMO_RUN:-runs/demo}/artifact/speculator"
EVAL_ARGS=(--max-tokens "${INTEROP_EVAL_TOKENS:-512}" --window 128)
read -r -a MODELS <<<"${INTEROP_MODELS:-fp8 w4a4 mixed}"
# The run whose directory holds the bf16 checks' results (smoke and acceptance write under its
# endpoints/): any of the artifacts' runs, all of them of the demo checkpoint.
HOST_RUN="$OUT/${MODELS[0]}"
SMOKE_ARGS=(--num-prompts "${INTEROP_SMOKE_PROMPTS:-20}" --max-tokens "${INTEROP_SMOKE_TOKENS:-128}")
CHECKS=" ${*:-eval smoke bench acceptance tests} "
wants() { [[ "$CHECKS" == *" $1 "* ]]; }
FAILED=()

timed() {  # LABEL COMMAND...: run it and print its time
  local label="$1" t0=$SECONDS
  shift
  "$@"
  echo "interop: $label took $((SECONDS - t0)) s"
}
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
vllm_up() {  # MODEL NAME [vllm args...]: a refusal is noted (the checks of that model are skipped) and the run fails at the end
  if scripts/interop_serve.sh "$1" "$VPORT" --served-model-name "$2" "${@:3}"; then return 0; fi
  echo "$2: vLLM refuses $1 (see $LOGS/vllm-$2.log)" >&2
  cp "$LOGS/vllm-$VPORT.log" "$LOGS/vllm-$2.log" 2>/dev/null || true
  FAILED+=("vLLM refused $2")
  return 1
}
vllm_down() {  # NAME: stop, keep the log under the model's name
  scripts/interop_serve.sh stop "$VPORT" >/dev/null
  cp "$LOGS/vllm-$VPORT.log" "$LOGS/vllm-$1.log" 2>/dev/null || true
}
trap 'onboard_down; scripts/interop_serve.sh stop "$VPORT" >/dev/null 2>&1 || true' EXIT

# A fixed token-id prompt (SmolLM2 ids of a ChatML "What is the capital of France? Answer in one
# word." turn), so that no tokenizer differences enter the comparison.
PROMPT_IDS="[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 2229, 30, 2, 198, 1, 520, 9531, 198]"
probe() {  # NAME: one prompt_logprobs completion (serves, or refuses); the response is kept
  curl -sf "$VLLM/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$1\", \"prompt\": $PROMPT_IDS, \"max_tokens\": 1, \"prompt_logprobs\": 5, \"temperature\": 0}" \
    >"$LOGS/probe-$1.json" || { FAILED+=("probe $1"); return 0; }
  echo "$1: prompt_logprobs answered ($(wc -c <"$LOGS/probe-$1.json") bytes, $LOGS/probe-$1.json)"
}
eval_endpoint() {  # RUN URL LABEL: top-20 (a lower bound) and the full vocabulary
  for k in ${INTEROP_EVAL_TOPK:-20 -1}; do
    "$ONBOARD" eval "$1" "${EVAL_ARGS[@]}" --endpoint "$2" --top-logprobs "$k" --out "$RESULTS/eval-$3-k$k.json"
  done
}

# ---- the demo checkpoint (bf16): probe, smoke, bench, the agreement test --------------------------
if vllm_up "$DEMO" bf16 --max-num-seqs 16; then
  probe bf16
  if wants smoke && [[ " ${INTEROP_SMOKE_MODELS:-bf16 fp8} " == *" bf16 "* ]]; then
    # The reference is the local engine on the original checkpoint (the run's): bf16 is served from
    # the demo checkpoint itself, so its rates should equal the reference's.
    timed "smoke bf16" "$ONBOARD" smoke "$HOST_RUN" "${SMOKE_ARGS[@]}" --endpoint "$VLLM"
    cp "$HOST_RUN/endpoints/127.0.0.1_$VPORT/smoke/smoke.json" "$RESULTS/smoke-bf16-vllm.json"
  fi
  if wants bench; then
    onboard_up "$DEMO" bf16
    timed "bench bf16" "$ONBOARD" bench "$DEMO" --endpoint "$OWN" --endpoint "$VLLM" --concurrency "${INTEROP_BENCH_CONCURRENCY:-1,4,16}" \
      --max-tokens 64 --out "$RESULTS/bench-bf16.json"
    onboard_down
  fi
  if wants tests; then
    timed "agreement test" env INTEROP_VLLM_BF16="$VLLM" .venv/bin/python -m pytest -q -m interop \
      tests/test_interop.py -k agree || FAILED+=("tests/test_interop.py agreement")
  fi
  vllm_down bf16
fi

# ---- the artifacts: probe and eval, vLLM then onboard serve ---------------------------------------
for name in "${MODELS[@]}"; do
  run="$OUT/$name"
  if wants eval; then
    timed "eval $name in process" "$ONBOARD" eval "$run" "${EVAL_ARGS[@]}" --out "$RESULTS/eval-$name-inprocess.json"
  fi
  if vllm_up "$run/artifact" "$name"; then
    probe "$name"
    if wants eval; then timed "eval $name vLLM" eval_endpoint "$run" "$VLLM" "$name-vllm"; fi
    if wants smoke && [[ "$name" == fp8 && " ${INTEROP_SMOKE_MODELS:-bf16 fp8} " == *" fp8 "* ]]; then
      # vLLM CPU decodes the FP8 artifact at about 2 tokens/s (13x slower than bf16 here): CI smokes bf16 only.
      timed "smoke fp8" "$ONBOARD" smoke "$OUT/fp8" "${SMOKE_ARGS[@]}" --endpoint "$VLLM"
      cp "$OUT/fp8/endpoints/127.0.0.1_$VPORT/smoke/smoke.json" "$RESULTS/smoke-fp8-vllm.json"
    fi
    vllm_down "$name"
  fi
  if wants eval; then
    onboard_up "$run/artifact" "$name"
    timed "eval $name onboard serve" eval_endpoint "$run" "$OWN" "$name-onboard"
    onboard_down
  fi
done

# ---- speculator acceptance: bf16 with the EAGLE-3 draft --------------------------------------------
if wants acceptance; then
  spec="{\"method\": \"eagle3\", \"model\": \"$(realpath "$DRAFT")\", \"num_speculative_tokens\": 3}"
  if scripts/interop_serve.sh "$DEMO" "$VPORT" --served-model-name bf16 --speculative-config "$spec"; then
    timed "acceptance vLLM" "$ONBOARD" speculator "$HOST_RUN" --endpoint "$VLLM"
    cp "$HOST_RUN/endpoints/127.0.0.1_$VPORT/speculator/metrics.json" "$RESULTS/acceptance-vllm.json"
    vllm_down bf16-eagle3
  else  # a refusal is a finding of its own (docs/benchmarks.md), not a failure
    grep -oE '[A-Za-z]*Error: .*' "$LOGS/vllm-$VPORT.log" | tail -n 3 >"$RESULTS/acceptance-vllm-refusal.txt" || true
  fi
  onboard_up "$DEMO" bf16 --speculator "$DRAFT"
  timed "acceptance onboard serve" "$ONBOARD" speculator "$HOST_RUN" --endpoint "$OWN"
  cp "$HOST_RUN/endpoints/127.0.0.1_$OPORT/speculator/metrics.json" "$RESULTS/acceptance-onboard.json"
  onboard_down
fi

# ---- the tests that serve their own model ------------------------------------------------------------
if wants tests; then
  timed "MTP test" .venv/bin/python -m pytest -q -m interop tests/test_interop.py -k "not agree" \
    || FAILED+=("tests/test_interop.py MTP")
fi

.venv/bin/python scripts/interop_table.py "$RESULTS"
if ((${#FAILED[@]})); then
  printf 'interop: FAILED: %s\n' "${FAILED[@]}" >&2
  exit 1
fi

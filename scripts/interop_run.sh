#!/usr/bin/env bash
# `make interop`: onboard's artifacts served by vLLM (CPU build in .venv-vllm).
#
#   scripts/interop_run.sh            prepare the artifacts, then every check (scripts/interop_checks.sh)
#
# Stage 1 prepares the artifacts: FP8 and NVFP4 W4A4 by round to nearest (this checks how vLLM
# serves a format, not a method), and the mixed-precision one taken from the demo's run when
# `make demo` made one (CI runs the demo first), else quantized with the demo's recipe. Stage 2
# starts each server once and runs every check of its model against it (scripts/interop_checks.sh),
# the tests marked `interop` included. Everything runs one process after another: on 2 cores a
# quantize beside a server (or two servers) slows both several-fold.
#
# Environment: DEMO (the bf16 checkpoint; default: `onboard demo --fetch-only`), INTEROP_DIR
# (default runs/interop), INTEROP_DEMO_RUN (default runs/demo), INTEROP_PORT (default 8011),
# INTEROP_REQUANTIZE=1 to redo artifacts, INTEROP_MODELS (the artifacts: fp8 w4a4 mixed; CI's
# `mixed` alone holds both formats, FP8 and NVFP4 W4A4 groups, in one artifact).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ONBOARD="$ROOT/.venv/bin/onboard"
OUT="${INTEROP_DIR:-runs/interop}"
DEMO_RUN="${INTEROP_DEMO_RUN:-runs/demo}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"

DEMO="${DEMO:-$("$ONBOARD" demo --fetch-only | tail -n 1)}"
[[ -f "$DEMO/config.json" ]] || { echo "demo checkpoint not found: $DEMO" >&2; exit 1; }

# ---- stage 1: artifacts (each quantize alone on the machine) -----------------------------------
have() { [[ -f "$OUT/$1/artifact/config.json" && "${INTEROP_REQUANTIZE:-0}" != 1 ]]; }
quantize() {  # NAME ONBOARD-QUANTIZE-ARGS...
  local name="$1"; shift
  if have "$name"; then echo "artifact $OUT/$name/artifact exists (INTEROP_REQUANTIZE=1 to redo)"; return; fi
  echo "quantize $name ..."
  local t0=$SECONDS
  "$ONBOARD" quantize "$DEMO" --out "$OUT/$name" "$@" >"$LOGS/quantize-$name.log" 2>&1 \
    || { tail -n 30 "$LOGS/quantize-$name.log" >&2; exit 1; }
  echo "quantize $name: $((SECONDS - t0))s"
}
MODELS=" ${INTEROP_MODELS:-fp8 w4a4 mixed} "
wanted() { [[ "$MODELS" == *" $1 "* ]]; }
if wanted fp8; then quantize fp8 --scheme fp8 --method rtn; fi
# Round to nearest needs calibration only for the activations' global scales: 16 samples do.
if wanted w4a4; then quantize w4a4 --scheme nvfp4 --method rtn --num-samples 16; fi
# The demo's run quantized the demo checkpoint with recipes/smollm2-mixed.yaml: a copy of it (the
# checks write their own eval into the run they are given, not into the demo's).
demo_quantized() {
  [[ -f "$DEMO_RUN/artifact/config.json" ]] || return 1
  "$ROOT/.venv/bin/python" - "$DEMO_RUN" <<'EOF'
import json, sys
stages = json.load(open(f"{sys.argv[1]}/manifest.json"))["stages"]
sys.exit(0 if stages.get("quantize", {}).get("status") == "done" else 1)
EOF
}
if wanted mixed && ! have mixed && demo_quantized; then
  rm -rf "$OUT/mixed"
  mkdir -p "$OUT/mixed"
  cp -a "$DEMO_RUN/manifest.json" "$DEMO_RUN/quantize" "$DEMO_RUN/artifact" "$OUT/mixed/"
  echo "artifact $OUT/mixed/artifact: the demo run's ($DEMO_RUN)"
fi
if wanted mixed; then quantize mixed --recipe recipes/smollm2-mixed.yaml; fi

# ---- stage 2: each server once, every check of its model -----------------------------------------
DEMO="$DEMO" INTEROP_DIR="$OUT" INTEROP_DEMO_RUN="$DEMO_RUN" scripts/interop_checks.sh

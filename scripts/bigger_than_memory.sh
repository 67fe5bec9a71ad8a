#!/usr/bin/env bash
# Every streamed stage on a checkpoint far larger than the memory it may use:
#
#   scripts/bigger_than_memory.sh [WORK_DIR] [CAP]        # defaults: /work/scale, 6GB
#
# Builds a random-weight DeepSeek-V3.2-shaped checkpoint of about 16 GB of bf16 safetensors
# (scripts/scale_checkpoint.py, the demo's tokenizer), then runs quantize (NVFP4 W4A4, calibrated),
# eval (two passes and the per-layer KL), adapt --layerwise and the speculator's streamed data
# under a hard memory cap: a cgroup (v1 or v2) where this machine lets us create one, else
# `--max-memory` alone (said in the table).  Each stage's peak resident memory (the process's
# max RSS; the cgroup's peak, page cache included, beside it) and seconds go to WORK_DIR/scale.md.
set -euo pipefail

WORK=${1:-/work/scale}
CAP=${2:-6GB}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
ONBOARD=("$PY" -m onboard)
CK=$WORK/ds32-16g
RUN=$WORK/run
RECIPE=$WORK/scale.yaml
TABLE=$WORK/scale.md
mkdir -p "$WORK"

DEMO=$("${ONBOARD[@]}" demo --fetch-only | tail -1)
if [ ! -f "$CK/config.json" ]; then
  "$PY" "$ROOT/scripts/scale_checkpoint.py" "$CK" --tokenizer "$DEMO" --layers 26
fi

# Few calibration samples and eval tokens: the point is the memory bound, and each token costs
# a pass of 16 GB of experts through two CPU cores.
cat > "$RECIPE" <<'EOF'
# scripts/bigger_than_memory.sh writes and runs this recipe
name: scale-run
quantize:
  scheme: nvfp4
  calibration: {num_samples: 8, max_seq_length: 128}
eval: {max_tokens: 1024, window: 256, per_layer_tokens: 256}
speculator: {num_prompts: 16, stdlib_files: 2, epochs: 1, eval_prompts: 0, teacher_forced_max_sequences: 32, batch_sequences: 1, max_seq_len: 256}
EOF

CAP_BYTES=$("$PY" -c "from onboard.budget import parse_size; print(parse_size('$CAP'))")
CGROUP=""
if [ -d /sys/fs/cgroup/memory ] && mkdir -p /sys/fs/cgroup/memory/onboard_scale 2>/dev/null; then
  CGROUP=/sys/fs/cgroup/memory/onboard_scale
  echo "$CAP_BYTES" > $CGROUP/memory.limit_in_bytes
  [ -f $CGROUP/memory.memsw.limit_in_bytes ] && echo "$CAP_BYTES" > $CGROUP/memory.memsw.limit_in_bytes || true
  PEAK_FILE=$CGROUP/memory.max_usage_in_bytes
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && mkdir -p /sys/fs/cgroup/onboard_scale 2>/dev/null; then
  CGROUP=/sys/fs/cgroup/onboard_scale
  echo "$CAP_BYTES" > $CGROUP/memory.max
  PEAK_FILE=$CGROUP/memory.peak
fi

{
  echo "| stage | command | peak RSS | cgroup peak (with page cache) | seconds | exit |"
  echo "|---|---|---|---|---|---|"
} > "$TABLE"

stage() {
  local name=$1; shift
  [ -n "$CGROUP" ] && [ -f "$CGROUP/memory.max_usage_in_bytes" ] && echo 0 > "$CGROUP/memory.max_usage_in_bytes"
  local start end rc=0
  start=$(date +%s)
  if [ -n "$CGROUP" ]; then
    sh -c "echo \$\$ > $CGROUP/cgroup.procs && exec /usr/bin/time -f '%M' -o $WORK/$name.rss \"\$@\"" _ "$@" \
      > "$WORK/$name.log" 2>&1 || rc=$?
  else
    /usr/bin/time -f '%M' -o "$WORK/$name.rss" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
  fi
  end=$(date +%s)
  local rss cg="—"
  rss=$(awk 'END {printf "%.2f GB", $1 * 1024 / 1e9}' "$WORK/$name.rss")
  [ -n "$CGROUP" ] && cg=$(awk '{printf "%.2f GB", $1 / 1e9}' "$PEAK_FILE")
  echo "| $name | \`onboard ${*:4}\` | $rss | $cg | $((end - start)) | $rc |" >> "$TABLE"
  echo "$name: exit $rc, peak RSS $rss, cgroup $cg, $((end - start)) s"
}

stage quantize "${ONBOARD[@]}" quantize "$CK" --out "$RUN" --recipe "$RECIPE" --max-memory "$CAP"
stage eval "${ONBOARD[@]}" eval "$RUN" --max-memory "$CAP"
stage adapt-layerwise "${ONBOARD[@]}" adapt "$RUN" --layerwise --max-memory "$CAP"
stage speculator-data "${ONBOARD[@]}" speculator "$RUN" --max-memory "$CAP"

if [ -n "$CGROUP" ]; then
  echo "" >> "$TABLE"
  echo "memory cap: $CAP ($CAP_BYTES bytes) as cgroup $CGROUP" >> "$TABLE"
  rmdir "$CGROUP" 2>/dev/null || true
else
  echo "" >> "$TABLE"
  echo "memory cap: NOT enforced (no writable cgroup here); --max-memory $CAP only" >> "$TABLE"
fi
cat "$TABLE"

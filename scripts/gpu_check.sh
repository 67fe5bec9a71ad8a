#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): a random-weight Llama-3-8B-shaped model built on the device,
# the engine against transformers on it (throughput; exact parity in fp32/bf16 against one copy of
# each prompt, bf16 required bitwise; FP8 and NVFP4 artifacts made by onboard's quantize stage,
# judged by the near-tie and layerwise-distribution rules; speculative decoding's exactness; NVFP4
# scale distillation on the device).
# Creates nothing itself; the check writes its JSON (--out, default gpu_check.json) and removes its
# temporary checkpoint and artifacts. Exit 0: the checks passed (phases skipped for --deadline are
# listed as not checked).
#
#   scripts/gpu_check.sh                                  # llama3-8b shape on cuda (one H200: < 9 min)
#   scripts/gpu_check.sh --shape tiny --device cpu        # the same code on the CPU (< 1 min)
#   scripts/gpu_check.sh --phases distill --distill-tokens 16384   # distillation alone, a larger budget
#   scripts/gpu_check.sh --out "$OUT/gpu_check.json"      # see --help for the rest
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="$ROOT/.venv/bin/python"
[[ -x "$PYTHON" ]] || PYTHON=python
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"

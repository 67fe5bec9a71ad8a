#!/usr/bin/env bash
# Start / stop a vLLM (CPU build, .venv-vllm) OpenAI server for the interop checks.
#
#   scripts/interop_serve.sh MODEL_DIR PORT [extra vllm args...]   start, wait for /health 200
#   scripts/interop_serve.sh stop PORT                              stop the server on PORT
#
# One server at a time on a small machine: two torch processes on 2 cores slow each other
# several-fold. Files: runs/interop/logs/vllm-PORT.{pid,log}; the startup time (seconds from
# launch to the first /health 200) is printed and appended to runs/interop/logs/startup.tsv.
#
# Environment (defaults for a 2-core, 24 GB machine; override by exporting them):
#   VLLM_CPU_KVCACHE_SPACE     KV cache in GiB (vLLM CPU's default is 4; 1 is plenty for 2048 tokens)
#   VLLM_CPU_OMP_THREADS_BIND  cores for the worker's OpenMP threads. vLLM's "auto" reserves one
#                              core per rank for the scheduler, which leaves 1 of 2 cores for the
#                              model; "0-<n-1>" gives the worker all of them.
#   INTEROP_HEALTH_TIMEOUT     seconds to wait for /health (default 600)
#   INTEROP_VLLM_PYTHON        interpreter (default .venv-vllm/bin/python; the `vllm` console
#                              script of vllm-cpu 0.32 fails, the module entry point works)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="$ROOT/runs/interop/logs"
PY="${INTEROP_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}"
TIMEOUT="${INTEROP_HEALTH_TIMEOUT:-600}"

usage() { sed -n '2,6p' "$0" >&2; exit 2; }

explain() {  # the root-cause lines first (vLLM's traceback is long), then the tail
  echo "$1 Errors in $LOG:" >&2
  grep -oE '\b[A-Z][A-Za-z]*(Error|Exception): .*' "$LOG" | grep -v 'increasing with ulimit' | awk '!seen[$0]++' | tail -n 5 >&2 || true
  echo "--- last 25 lines of $LOG:" >&2
  tail -n 25 "$LOG" >&2
}

stop_server() {
  local port="$1" pidfile="$LOGS/vllm-$1.pid"
  if [[ ! -f "$pidfile" ]]; then echo "no server recorded on port $port" >&2; return 0; fi
  local pid; pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    # The server was started with setsid: its process group holds the engine core and workers.
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pidfile"
  echo "stopped vLLM on port $port (pid $pid)"
}

[[ $# -ge 2 ]] || usage
if [[ "$1" == "stop" ]]; then stop_server "$2"; exit 0; fi

MODEL="$1"; PORT="$2"; shift 2
[[ -d "$MODEL" ]] || { echo "model directory not found: $MODEL" >&2; exit 2; }
[[ -x "$PY" ]] || { echo "no vLLM interpreter at $PY (run: make interop)" >&2; exit 2; }
mkdir -p "$LOGS"
PIDFILE="$LOGS/vllm-$PORT.pid"; LOG="$LOGS/vllm-$PORT.log"
if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
  echo "a server is already running on port $PORT (pid $(cat "$PIDFILE")); stop it first" >&2; exit 1
fi

NCPU="$(nproc)"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$((NCPU - 1))}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# --enforce-eager: no torch.compile/inductor pass (minutes of compiling on 2 cores, and fused
# kernels would round differently from the eager reference). --max-logprobs -1: prompt_logprobs
# over the full vocabulary. Extra args come last and win.
START="$(date +%s.%N)"
setsid "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --max-logprobs -1 --dtype bfloat16 --max-model-len 2048 \
  --max-num-seqs 4 --max-num-batched-tokens 2048 --enforce-eager \
  "$@" >"$LOG" 2>&1 < /dev/null &
echo $! >"$PIDFILE"
PID="$(cat "$PIDFILE")"

while true; do
  code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" 2>/dev/null || true)"
  [[ "$code" == "200" ]] && break
  if ! kill -0 "$PID" 2>/dev/null; then
    explain "vLLM exited before /health answered ($MODEL)."; rm -f "$PIDFILE"; exit 1
  fi
  if (( $(date +%s) - ${START%.*} > TIMEOUT )); then
    explain "vLLM did not answer /health within ${TIMEOUT}s ($MODEL)."; stop_server "$PORT" >&2; exit 1
  fi
  sleep 1
done
SECS="$(awk -v a="$START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
printf '%s\t%s\t%s\n' "$(date -Is)" "$MODEL" "$SECS" >>"$LOGS/startup.tsv"
echo "vLLM up on http://127.0.0.1:$PORT (pid $PID, ${SECS}s, log $LOG)"

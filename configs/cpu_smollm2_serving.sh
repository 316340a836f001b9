#!/usr/bin/env bash
# Serving benchmark on CPU: the embedded SmolLM2-135M-Instruct (float32),
# random 128-token prompts, 64 output tokens (EOS ignored), at concurrency 1 and 16.
# Usage: configs/cpu_smollm2_serving.sh [results-dir]
set -euo pipefail
OUT=${1:-benchmarks/results}
PORT=${PORT:-8011}
DEVICE_KIND=${DEVICE_KIND:-cpu-2core}
mkdir -p "$OUT"

gyrfalcon serve --port "$PORT" --dtype float32 --device cpu --log-level warning &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server died" >&2; exit 1; }
  sleep 1
done

# NOTE: a seed of each concurrency's own: with one seed the c16 burst's first 8 prompts
# would be c1's, found in the prefix cache
for C in 1 16; do
  N=$(( C == 1 ? 8 : 64 ))
  gyrfalcon bench serve --port "$PORT" --num-prompts "$N" --random-input-len 128 \
    --random-output-len 64 --ignore-eos --max-concurrency "$C" --seed "$C" --disable-tqdm --device-kind "$DEVICE_KIND" \
    --output-json "$OUT/serving_cpu_smollm2_c${C}.json"
done

